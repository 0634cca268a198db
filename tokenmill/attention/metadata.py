"""What attention needs to know about a flat batch, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

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

    @cached_property
    def num_leading_decodes(self) -> int:
        """Requests at the front of the batch with one query token each (the scheduler puts running
        requests first): a mixed step's decode rows, which a backend may run with its decode kernel.
        Counted once per step, on the host."""
        qsl, n = self.query_start_loc_cpu, 0
        while n < self.num_reqs and qsl[n + 1] - qsl[n] == 1:
            n += 1
        return n

    @cached_property
    def rest_query_start_loc(self) -> torch.Tensor:
        """[num_reqs - num_leading_decodes + 1] int32: the other requests' query starts, counted from
        their first row (made once per step, on the device)."""
        d = self.num_leading_decodes
        return self.query_start_loc[d:] - d
