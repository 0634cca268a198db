"""Reference paged attention: one request at a time, plain tensor ops, fp32 softmax.
Slow and obviously right; every fast backend is tested against it."""

from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.windowed import masked_scores


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new k/v rows into their cache slots (rounded to the cache's dtype). k, v: [num_tokens, Hkv, D]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's keys and values in token order: two [seq_len, Hkv, D] tensors."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


class TorchRefBackend:
    name = "torch_ref"
    supports_cuda_graphs = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        group = q.shape[1] // kv_cache.shape[-2]
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            ctx_k, ctx_v = gather_context(kv_cache, meta.block_tables[i], seq_len)
            ctx_k = ctx_k.repeat_interleave(group, dim=1).float()  # [seq_len, Hq, D]
            ctx_v = ctx_v.repeat_interleave(group, dim=1).float()
            qi = q[start:end].float()  # [q_len, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", qi, ctx_k) * scale  # [Hq, q_len, seq_len]
            # Query j sits at position seq_len - q_len + j and sees keys up to it (and within the window).
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            probs = masked_scores(scores, q_pos, k_pos, sliding_window, logit_softcap).softmax(dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, ctx_v).to(q.dtype)
        return out
