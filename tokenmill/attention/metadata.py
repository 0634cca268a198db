"""What attention needs to know about a flat batch, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: request i's tokens are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset) per token
    # Host copies, so backends can plan without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # KV layer groups 1, 2, ... (sliding-window layers: tokenmill/kv_groups.py): the same batch over each
    # group's own block tables and slot mapping. Empty when the model has one group.
    group_metadata: list[AttentionMetadata] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1
