"""The fast CPU attention path (also runs on GPU without its C++ part).

Over a bf16 or int8 cache on a CPU with AVX-512 BF16, every row of a step (decode rows and prompt chunks, a
cached prefix included) goes to one call of our C++ paged-attention kernel, which reads the KV blocks
in place; such a cache holds its blocks in the kernel's pair layout (attention/pair_layout.py), which
our C++ write_kv writes. Otherwise the rows of requests with short queries (decode rows, speculative
decoding's verification steps: up to SHORT_QUERY_LEN tokens) go to the C++ paged-decode kernel (float32
or bf16 cache) as one row per token, in one call, or where it cannot be built (or off CPU) to one SDPA
call over gathered, padded contexts; longer prompt chunks run one request at a time through SDPA, with
the plain causal kernel when there is no cached prefix. Sliding-window and soft-capped layers (Gemma) take
the PyTorch path of attention/windowed.py over a plain-layout cache."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.pair_layout import cache_row_width
from tokenmill.attention.torch_ref import gather_context, write_kv
from tokenmill.attention.windowed import windowed_attention
from tokenmill.ops import build

# Requests with up to this many query tokens attend as rows of one paged-decode call (TokenRows): a
# verification step's 1 + k tokens, k up to 8 draft tokens. Longer chunks go to SDPA one by one.
SHORT_QUERY_LEN = 9


class TokenRows(NamedTuple):
    """A step's short-query requests as one query row per token, the form paged decode takes: each
    row has its request's block table and a context up to and including its own token (causal)."""

    rows: torch.Tensor  # [n] int64: the tokens' rows in the step
    block_tables: torch.Tensor  # [n, max_blocks] int32: each row's request's table
    seq_lens: torch.Tensor  # [n] int32: each row's context, its own token the last
    max_seq_len: int
    long_reqs: list[int]  # the requests with longer queries (SDPA, one at a time)


def token_rows(meta: AttentionMetadata) -> TokenRows:
    qsl = meta.query_start_loc_cpu
    rows: list[int] = []
    reqs: list[int] = []
    lens: list[int] = []
    long_reqs: list[int] = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end - start > SHORT_QUERY_LEN:
            long_reqs.append(i)
            continue
        rows.extend(range(start, end))
        reqs.extend([i] * (end - start))
        lens.extend(seq_len - (end - row) + 1 for row in range(start, end))
    device = meta.block_tables.device
    return TokenRows(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_tables=meta.block_tables[torch.tensor(reqs, dtype=torch.int64, device=device)],
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_seq_len=max(lens, default=0),
        long_reqs=long_reqs,
    )


class SDPABackend:
    name = "sdpa"
    supports_cuda_graphs = False  # its KV write (index_copy_) cannot skip the graph runner's padding slots

    def __init__(self, device: torch.device, use_cpp_kernels: bool = True) -> None:
        self._kernels = build.load("paged_decode") if use_cpp_kernels and device.type == "cpu" else None
        if self._kernels is not None:
            self.name = "cpu"
        # The last step's TokenRows: every layer of a step gets the same metadata object.
        self._token_rows: tuple[AttentionMetadata, TokenRows] | None = None

    def serves_int8_cache(self, block_size: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether this backend reads an int8 cache of these shapes (only the AVX-512 BF16 kernel does)."""
        probe = torch.empty(2, 1, block_size, num_kv_heads, cache_row_width(head_dim, "int8"), dtype=torch.int8)
        return self._kernels is not None and bool(self._kernels.avx512_supports(probe))

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
        if sliding_window is not None or logit_softcap is not None:
            # The kernels do neither: such a layer's cache holds the plain layout, written and read in PyTorch.
            if kv_cache.dtype == torch.int8:
                raise ValueError(
                    "kv_cache_dtype 'int8' does not serve sliding-window or soft-capped attention layers "
                    "(Gemma); use a bfloat16 or float32 KV cache."
                )
            write_kv(k, v, kv_cache, meta.slot_mapping)
            return windowed_attention(q, kv_cache, meta, scale, sliding_window, logit_softcap)
        if self._kernels is not None and self._kernels.avx512_supports(kv_cache):
            self._kernels.write_kv(k, v, kv_cache, meta.slot_mapping)
            return self._kernels.paged_attention(  # q, k, v: views of the QKV output, read in place
                q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
            )
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.is_all_decode:
            return self._decode_rows(q, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
        out = torch.empty_like(q)
        short = self._rows_of(meta)
        if short.rows.numel():
            out[short.rows] = self._decode_rows(
                q[short.rows], kv_cache, short.block_tables, short.seq_lens, short.max_seq_len, scale
            )
        qsl = meta.query_start_loc_cpu
        for i in short.long_reqs:
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], kv_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale
            )
        return out

    def _rows_of(self, meta: AttentionMetadata) -> TokenRows:
        if self._token_rows is None or self._token_rows[0] is not meta:
            self._token_rows = (meta, token_rows(meta))
        return self._token_rows[1]

    def _decode_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        if self._kernels is not None and kv_cache.dtype in (torch.float32, torch.bfloat16):
            return self._kernels.paged_decode(q.contiguous(), kv_cache, block_tables, seq_lens, scale)
        return self._decode_sdpa(q, kv_cache, block_tables, seq_lens, max_seq_len, scale)

    @staticmethod
    def _decode_sdpa(
        q: torch.Tensor,  # [B, Hq, D]
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        max_seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        batch, _, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        num_blocks = -(-max_seq_len // block_size)
        table = block_tables[:, :num_blocks].long()
        # [B, num_blocks, block_size, Hkv, D] -> [B, Hkv, S, D]
        ctx_k = kv_cache[0][table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        ctx_v = kv_cache[1][table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        positions = torch.arange(ctx_k.shape[2], device=q.device)
        mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1)).view(batch, 1, 1, -1)  # [B, 1, 1, S]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), ctx_k, ctx_v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, Hq, 1, D]
        return out.squeeze(2)

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # [q_len, Hq, D]
        k: torch.Tensor,  # [q_len, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        q_len = q.shape[0]
        if seq_len == q_len:  # no cached prefix: the new tokens are the whole context
            mask = None
            ctx_k, ctx_v = k, v
        else:
            ctx_k, ctx_v = (c.to(q.dtype) for c in gather_context(kv_cache, block_table, seq_len))
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, seq_len]
        # 4-D inputs: on CPU, 3-D ones miss torch's flash kernel and run ~3x slower.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
            ctx_k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, seq_len, D]
            ctx_v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [q_len, Hq, D]
