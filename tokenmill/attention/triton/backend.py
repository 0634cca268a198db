"""`TritonBackend`: the AttentionBackend of Triton kernels, for CUDA devices.

Per layer and step: one kernel writes the step's k/v into the paged cache, then
- the decode rows (all rows when max_query_len == 1; else the leading requests with one query token,
  where the scheduler puts the running ones): split-K decode, then the split reduce;
- the rest (prompts, prompt chunks after cached prefixes): one variable-length prefill launch. Decode
  rows in prefill tiles would fill a tile of BLOCK_M rows with one GQA group's few.

CUDA-graph safety of the decode path: it reads only device tensors and two host numbers,
q.shape[0] and meta.max_seq_len (for the split count). A graph runner captures with
max_seq_len = max_model_len, which fixes the split count per batch bucket; each request's split
lengths then follow its live seq_len on the device, so a replay is right at any length.

Sliding-window and soft-capped layers (Gemma) take the PyTorch path of attention/windowed.py (not
graph-safe: the model runner runs such models eagerly)."""

from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.triton.decode import DecodeTiles, choose_num_splits, decode_attention
from tokenmill.attention.triton.kv_write import write_kv
from tokenmill.attention.triton.prefill import PrefillTiles, prefill_attention
from tokenmill.attention.triton.util import num_sms
from tokenmill.attention.windowed import windowed_attention


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True  # see the module docstring

    def __init__(
        self,
        device: torch.device,
        num_splits: int | None = None,
        prefill_tiles: PrefillTiles | None = None,
        decode_tiles: DecodeTiles | None = None,
    ) -> None:
        """num_splits / tiles: fixed choices instead of the heuristics (tests, tuning)."""
        self.device = device
        self.num_splits = num_splits
        self.prefill_tiles = prefill_tiles
        self.decode_tiles = decode_tiles

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if sliding_window is not None or logit_softcap is not None:  # the kernels do neither
            return windowed_attention(q, kv_cache, meta, scale, sliding_window, logit_softcap)
        out = torch.empty_like(q)  # [num_tokens, Hq, D]
        d = q.shape[0] if meta.is_all_decode else meta.num_leading_decodes  # decode rows: the first d
        if d:
            num_splits = self.num_splits or choose_num_splits(d, kv_cache.shape[3], meta.max_seq_len, num_sms(q.device))
            tables, lens = meta.block_tables[:d], meta.seq_lens[:d]
            decode_attention(q[:d], kv_cache, tables, lens, out[:d], scale, num_splits, self.decode_tiles)
        if d < q.shape[0]:
            qsl = meta.rest_query_start_loc if d else meta.query_start_loc
            prefill_attention(
                q[d:],
                kv_cache,
                meta.block_tables[d:],
                meta.seq_lens[d:],
                qsl,
                out[d:],
                scale,
                meta.max_query_len,
                self.prefill_tiles,
            )
        return out
