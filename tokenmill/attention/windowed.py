"""Paged attention with a sliding window and/or tanh soft-capping of the scores (Gemma 2 and 3), in plain
PyTorch: the path every backend takes for such layers (the C++ and Triton kernels do neither).

The rule, as HF's Gemma masks: query position p sees key position j when p - window < j <= p, and
capped scores are cap * tanh(score / cap), taken before the mask and the softmax. Each request reads only
the blocks that hold keys within its queries' reach, so a window layer's freed blocks (whose table
entries may name any block: see scheduling/kv_cache_manager.py) are never read."""

from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata


def masked_scores(
    scores: torch.Tensor,  # [Hq, q_len, ctx_len] float32, scaled
    q_pos: torch.Tensor,  # [q_len] int64: each query's position
    k_pos: torch.Tensor,  # [ctx_len] int64: each key's position
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Soft-cap, then mask out future keys and keys behind the window (-inf)."""
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    hidden = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [q_len, ctx_len]
    if sliding_window is not None:
        hidden |= k_pos.unsqueeze(0) <= q_pos.unsqueeze(1) - sliding_window
    return scores.masked_fill(hidden, float("-inf"))


def windowed_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], this step's k/v written already
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """One request at a time over the blocks its queries can reach (all-decode steps: every request in
    one batched pass); fp32 scores. Returns [num_tokens, Hq, D]."""
    if meta.is_all_decode:
        return _decode(q, kv_cache, meta, scale, sliding_window, logit_softcap)
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[-2]
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        first_q = seq_len - (end - start)
        # The first key any of these queries sees, rounded down to its block.
        first_k = max(0, first_q - sliding_window + 1) if sliding_window is not None else 0
        first_block = first_k // block_size
        blocks = meta.block_tables[i, first_block : -(-seq_len // block_size)].long()
        ctx_start = first_block * block_size
        ctx_k = kv_cache[0, blocks].flatten(0, 1)[: seq_len - ctx_start]  # [ctx_len, Hkv, D]
        ctx_v = kv_cache[1, blocks].flatten(0, 1)[: seq_len - ctx_start]
        ctx_k = ctx_k.repeat_interleave(group, dim=1).float()  # [ctx_len, Hq, D]
        ctx_v = ctx_v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), ctx_k) * scale  # [Hq, q_len, ctx_len]
        q_pos = torch.arange(first_q, seq_len, device=q.device)
        k_pos = torch.arange(ctx_start, seq_len, device=q.device)
        probs = masked_scores(scores, q_pos, k_pos, sliding_window, logit_softcap).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, ctx_v).to(q.dtype)
    return out


def _decode(
    q: torch.Tensor,  # [B, Hq, D]: one query per request, at position seq_len - 1
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Every request's blocks within reach gathered into one padded batch: [B, num_blocks * block_size]."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    seq_lens = meta.seq_lens.long()  # [B]
    table_width = meta.block_tables.shape[1]
    if sliding_window is None:
        first_block = torch.zeros_like(seq_lens)
        num_blocks = -(-meta.max_seq_len // block_size)
    else:
        first_block = (seq_lens - sliding_window).clamp(min=0) // block_size
        num_blocks = min(-(-(sliding_window - 1) // block_size) + 1, -(-meta.max_seq_len // block_size))
    cols = first_block.unsqueeze(1) + torch.arange(num_blocks, device=q.device)  # [B, num_blocks]
    blocks = meta.block_tables.gather(1, cols.clamp(max=table_width - 1)).long()
    ctx_k = kv_cache[0, blocks].view(batch, -1, num_kv_heads, head_dim).float()  # [B, L, Hkv, D]
    ctx_v = kv_cache[1, blocks].view(batch, -1, num_kv_heads, head_dim).float()
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, ctx_k) * scale  # [B, Hkv, G, L]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    k_pos = first_block.unsqueeze(1) * block_size + torch.arange(ctx_k.shape[1], device=q.device)  # [B, L]
    hidden = k_pos >= seq_lens.unsqueeze(1)
    if sliding_window is not None:
        hidden |= k_pos <= seq_lens.unsqueeze(1) - 1 - sliding_window
    probs = scores.masked_fill(hidden.view(batch, 1, 1, -1), float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, ctx_v)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
