"""Every attention backend against the pure-PyTorch reference on one mixed paged batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tokenmill.attention.cpu import SDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.pair_layout import dequantize_int8_cache, from_pair_layout, to_pair_layout
from tokenmill.attention.selector import get_backend
from tokenmill.ops import packed_gemm
from tokenmill.ops.build import cpu_has_avx512_bf16

BLOCK, HQ, HKV, D, NUM_BLOCKS = 16, 8, 2, 32, 64


def mixed_batch(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Four requests: a fresh prompt, a chunk after a cached prefix, and two decodes, with blocks
    scattered over the pool; the cache already holds random KV for the earlier positions."""
    gen = torch.Generator().manual_seed(0)
    computed = [0, 37, 50, 130]  # tokens already in the cache
    new = [21, 9, 1, 1]  # tokens of this step
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    max_blocks = 10
    tables = torch.zeros(4, max_blocks, dtype=torch.int32)
    slots: list[int] = []
    cursor = 0
    for i, (c, n) in enumerate(zip(computed, new)):
        nb = -(-(c + n) // BLOCK)
        tables[i, :nb] = perm[cursor : cursor + nb].to(torch.int32)
        cursor += nb
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(c, c + n)]
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, HKV, D, generator=gen).to(dtype)
    total = sum(new)
    q = torch.randn(total, HQ, D, generator=gen).to(dtype)
    k = torch.randn(total, HKV, D, generator=gen).to(dtype)
    v = torch.randn(total, HKV, D, generator=gen).to(dtype)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(computed, new)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
    )
    return q, k, v, cache, meta  # type: ignore[return-value]


def _pairs(backend: str, cache: torch.Tensor) -> bool:
    """Whether `backend` keeps this cache in the pair layout of our AVX-512 BF16 kernel."""
    kernels = SDPABackend(torch.device("cpu"))._kernels
    return backend == "cpu" and bool(kernels.avx512_supports(cache))


def _served(backend: str, cache: torch.Tensor) -> torch.Tensor:
    """The cache as `backend` stores it (pair layout or plain)."""
    return to_pair_layout(cache) if _pairs(backend, cache) else cache


def _plain(backend: str, cache: torch.Tensor) -> torch.Tensor:
    return from_pair_layout(cache) if _pairs(backend, cache) else cache


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_matches_reference_on_a_mixed_batch(backend: str, dtype: torch.dtype, tol: float) -> None:
    q, k, v, cache, meta = mixed_batch(dtype)
    ref_cache = cache.clone()
    cache = _served(backend, cache)
    expected = get_backend("torch_ref", torch.device("cpu")).forward(q, k, v, ref_cache, meta, D**-0.5)
    got = get_backend(backend, torch.device("cpu")).forward(q, k, v, cache, meta, D**-0.5)
    assert torch.equal(_plain(backend, cache), ref_cache)  # both wrote the same KV into the same slots
    assert (got.float() - expected.float()).abs().max().item() < tol


def test_cpp_decode_kernel_is_built_on_this_machine() -> None:
    # The fast path must not silently fall back: CI has a compiler and ninja.
    assert SDPABackend(torch.device("cpu"))._kernels is not None


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_float32_activations_over_a_bf16_cache(backend: str) -> None:
    """kv_cache_dtype bfloat16 under a float32 model: new k/v are rounded into the cache, and the
    decode rows, which read only the cache, match the reference reading the same bf16 values."""
    q, k, v, cache, meta = mixed_batch(torch.float32)
    ref_cache = cache.to(torch.bfloat16)
    cache = _served(backend, ref_cache.clone())
    expected = get_backend("torch_ref", torch.device("cpu")).forward(q, k, v, ref_cache, meta, D**-0.5)
    got = get_backend(backend, torch.device("cpu")).forward(q, k, v, cache, meta, D**-0.5)
    cache = _plain(backend, cache)
    assert got.dtype == torch.float32 and torch.equal(cache, ref_cache)
    assert torch.equal(cache[0].view(-1, HKV, D)[meta.slot_mapping], k.to(torch.bfloat16))
    decode_rows = meta.query_start_loc_cpu[2:4]  # requests 2 and 3 decode one token each
    kernels = SDPABackend(torch.device("cpu"))._kernels
    # the same bf16 cache values; the AVX-512 BF16 kernel also rounds queries and probabilities
    tol = 2e-2 if backend == "cpu" and _bf16_products(kernels, cache) else 1e-5
    assert (got[decode_rows] - expected[decode_rows]).abs().max().item() < tol
    # prompts attend to their own unrounded k/v in the SDPA path: bf16 rounding apart
    assert (got - expected).abs().max().item() < 2e-2


def test_cpp_decode_kernel_rejects_a_float16_cache() -> None:
    kernels = SDPABackend(torch.device("cpu"))._kernels
    q, _, _, cache, meta = mixed_batch(torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.paged_decode(q[:2].contiguous(), cache.half(), meta.block_tables[:2], meta.seq_lens[:2], D**-0.5)


def _gathered_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    query_start: list[int] | None = None,
    bf16_products: bool = False,
) -> torch.Tensor:
    """Causal attention in float64 over each sequence's gathered cache rows; sequence i's queries are
    rows query_start[i]:query_start[i + 1] of q (default: one each), the last of its lens[i] positions.
    bf16_products emulates the AVX-512 BF16 kernel: query times scale and the unnormalized
    probabilities rounded to bf16, the normalizing sum not.  q: [T, Hq, D] -> [T, Hq, D]."""
    block = cache.shape[2]
    group = q.shape[1] // cache.shape[3]
    starts = query_start if query_start is not None else list(range(len(lens) + 1))
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        first, last = starts[b], starts[b + 1]
        if n <= 0:
            continue
        slots = tables[b, torch.arange(n) // block].long() * block + torch.arange(n) % block
        k = cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        qs = q[first:last].float() * scale  # [m, Hq, D]
        if bf16_products:
            qs = qs.bfloat16()
        scores = torch.einsum("mhd,nhd->hmn", qs.double(), k)
        q_pos = torch.arange(n - (last - first), n).view(1, -1, 1)
        scores = scores.masked_fill(torch.arange(n).view(1, 1, -1) > q_pos, float("-inf"))
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        total = e.sum(-1, keepdim=True)
        if bf16_products:
            e = e.float().bfloat16().double()
        out[first:last] = torch.einsum("hmn,nhd->mhd", e / total, v)
    return out


def _bf16_products(kernels: object, cache: torch.Tensor) -> bool:
    """Whether the C++ kernels serve this cache with bf16 dot products (AVX-512 BF16 builds)."""
    return bool(kernels.avx512_supports(cache))  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 4, 128), (8, 2, 36)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [2, 11])
def test_cpp_decode_kernel_over_head_layouts(
    num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, num_seqs: int
) -> None:
    # GQA groups of 3, 7 (read in passes of 3 + 3 + 1 heads), 2 and 4 (3 + 1); head_dim 36 takes the portable
    # loops; 2 sequences split the work by kv head, 11 by sequence; lengths cover partial blocks and 0.
    kernels = SDPABackend(torch.device("cpu"))._kernels
    gen = torch.Generator().manual_seed(num_heads * head_dim + num_seqs)
    num_blocks, block = 96, 16
    lens = torch.randint(1, 70, (num_seqs,), generator=gen, dtype=torch.int32)
    lens[-1] = 0 if num_seqs > 2 else 33
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * 5].view(num_seqs, 5).to(torch.int32)
    cache = torch.randn(2, num_blocks, block, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    got = kernels.paged_decode(q, _served("cpu", cache), tables, lens, head_dim**-0.5)
    expected = _gathered_reference(q, cache, tables, lens, head_dim**-0.5, bf16_products=_bf16_products(kernels, cache))
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - expected).abs().max().item() < 1e-5


def test_avx512_kernel_serves_bf16_caches_where_the_cpu_has_it() -> None:
    # Built with -march=native: on a CPU with AVX-512 BF16 the fast path must not silently fall back
    # (under TOKENMILL_CPU_ISA=avx2 the kernel is built without it, and cpu_has_avx512_bf16 says so).
    kernels = SDPABackend(torch.device("cpu"))._kernels
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    assert kernels.avx512_supports(cache) == cpu_has_avx512_bf16()
    assert not kernels.avx512_supports(cache.float()) and not kernels.avx512_supports(cache[..., :48].contiguous())


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 4, 128), (4, 4, 32)])
@pytest.mark.parametrize("num_seqs", [3, 12])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "avx512"])
def test_paged_attention_over_prompt_chunks_and_decode_rows(
    num_heads: int, num_kv_heads: int, head_dim: int, num_seqs: int, amx: bool, amx_switch: AmxSwitch
) -> None:
    """Fresh prompts, chunks after a cached prefix (tiles of many query rows) and decode rows in one
    call, against the float64 reference emulating the bf16 products. 3 sequences split the work by kv
    head, 12 take all kv heads per item. Both products on AMX tiles, or the AVX-512 dot products."""
    amx_switch(amx)
    kernels = SDPABackend(torch.device("cpu"))._kernels
    gen = torch.Generator().manual_seed(num_heads * head_dim + num_seqs)
    num_blocks, block, max_blocks = 256, 16, 12
    cache = torch.randn(2, num_blocks, block, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    if not kernels.avx512_supports(cache):
        pytest.skip("paged_attention needs an AVX-512 BF16 build")
    q_lens = torch.randint(1, 60, (num_seqs,), generator=gen).tolist()
    q_lens[0], q_lens[-1] = 1, 130  # a decode row; a prompt of several tiles
    prefix = torch.randint(0, 50, (num_seqs,), generator=gen).tolist()
    prefix[1] = 0  # a fresh prompt
    lens = torch.tensor([p + n for p, n in zip(prefix, q_lens)], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, -1).to(torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    got = kernels.paged_attention(
        q, to_pair_layout(cache), tables, lens, torch.tensor(starts, dtype=torch.int32), head_dim**-0.5
    )
    expected = _gathered_reference(q, cache, tables, lens, head_dim**-0.5, starts, bf16_products=True)
    exact = _gathered_reference(q, cache, tables, lens, head_dim**-0.5, starts)
    assert got.shape == q.shape and got.dtype == q.dtype
    # Only an exp rounding differently across a bf16 boundary moves a probability by one bf16 step
    # (<= 2^-8 of it, times a value of a few units).
    assert (got.double() - expected).abs().max().item() < 5e-3
    assert (got.double() - exact).abs().max().item() < 3e-2  # the bf16 products themselves
    # q as the model passes it: a view of the fused QKV output, its rows wider than the q heads
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * num_kv_heads * head_dim, generator=gen)], dim=1)
    q_view = qkv[:, : num_heads * head_dim].view(q.shape)
    in_place = kernels.paged_attention(
        q_view, to_pair_layout(cache), tables, lens, torch.tensor(starts, dtype=torch.int32), head_dim**-0.5
    )
    assert torch.equal(in_place, got)


AmxSwitch = Callable[[bool], None]


@pytest.fixture
def amx_switch() -> Iterator[AmxSwitch]:
    """Sets the AMX kernels on or off for one test (skips where on is asked of a CPU without them)."""

    def switch(on: bool) -> None:
        if packed_gemm.set_amx(on) != on:
            pytest.skip("this CPU (or build) has no AMX-BF16 tiles")

    yield switch
    packed_gemm.set_amx(True)


def test_paged_attention_rejects_bad_query_starts() -> None:
    kernels = SDPABackend(torch.device("cpu"))._kernels
    q, _, _, cache, meta = mixed_batch(torch.float32)
    cache = cache.to(torch.bfloat16)
    if not kernels.avx512_supports(cache):
        pytest.skip("paged_attention needs an AVX-512 BF16 build")
    with pytest.raises(RuntimeError, match="query_start"):
        kernels.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc[:-1], D**-0.5)
    with pytest.raises(RuntimeError, match="at most its context"):  # more rows than context
        kernels.paged_attention(q, cache, meta.block_tables, meta.seq_lens - 1, meta.query_start_loc, D**-0.5)
    with pytest.raises(RuntimeError, match="at most its context"):  # a context past its block table
        kernels.paged_attention(q, cache, meta.block_tables[:, :2], meta.seq_lens, meta.query_start_loc, D**-0.5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16|AVX-512"):
        kernels.paged_attention(q, cache.half(), meta.block_tables, meta.seq_lens, meta.query_start_loc, D**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_the_pair_layout(dtype: torch.dtype) -> None:
    """The C++ write_kv puts each k/v row where to_pair_layout puts the plain layout's row, rounded
    like torch's conversion; out-of-range slots are refused."""
    kernels = SDPABackend(torch.device("cpu"))._kernels
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, 32, 16, 3, 64, dtype=torch.bfloat16)
    if not kernels.avx512_supports(cache):
        pytest.skip("the pair layout belongs to the AVX-512 BF16 kernel")
    slots = torch.randperm(32 * 16, generator=gen)[:200]  # a prompt's worth: the rows split across threads
    k = torch.randn(200, 3, 64, generator=gen).to(dtype)
    v = torch.randn(200, 3, 64, generator=gen).to(dtype)
    kernels.write_kv(k, v, cache, slots)
    plain = torch.zeros(2, 32, 16, 3, 64, dtype=torch.bfloat16)
    plain[0].view(-1, 3, 64)[slots] = k.to(torch.bfloat16)
    plain[1].view(-1, 3, 64)[slots] = v.to(torch.bfloat16)
    assert torch.equal(from_pair_layout(cache), plain) and torch.equal(cache, to_pair_layout(plain))
    # k and v as the model passes them: views of the fused QKV output, read in place
    qkv = torch.cat([torch.randn(200, 9 * 64, generator=gen).to(dtype), k.flatten(1), v.flatten(1)], dim=1)
    from_views = torch.zeros_like(cache)
    kernels.write_kv(qkv[:, 9 * 64 : 12 * 64].view(200, 3, 64), qkv[:, 12 * 64 :].view(200, 3, 64), from_views, slots)
    assert torch.equal(from_views, cache)
    for bad in (-1, 32 * 16):
        with pytest.raises(RuntimeError, match="out of range"):
            kernels.write_kv(k[:1], v[:1], cache, torch.tensor([bad]))


def test_paged_attention_never_reads_unwritten_slots() -> None:
    """Slots past each context hold NaN (as a reused block may hold anything): the outputs are those
    of the same context with zeros there, for even and odd context lengths (an odd one ends in half
    of a value pair)."""
    kernels = SDPABackend(torch.device("cpu"))._kernels
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, max_blocks = 6, 2, 64, 4
    lens = torch.tensor([1, 16, 17, 30, 33, 50], dtype=torch.int32)
    tables = torch.randperm(32, generator=gen)[: 6 * max_blocks].view(6, -1).to(torch.int32)
    clean = torch.zeros(2, 32, 16, num_kv_heads, head_dim, dtype=torch.bfloat16)
    for i, n in enumerate(lens.tolist()):
        slots = tables[i, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
        clean[:, :].flatten(1, 2)[:, slots] = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).bfloat16()
    if not kernels.avx512_supports(clean):
        pytest.skip("paged_attention needs an AVX-512 BF16 build")
    dirty = clean.clone()
    written = torch.zeros(32 * 16, dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        written[tables[i, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16] = True
    dirty.flatten(1, 2)[:, ~written] = float("nan")
    q = torch.randn(6, num_heads, head_dim, generator=gen)
    got = kernels.paged_decode(q, to_pair_layout(dirty), tables, lens, head_dim**-0.5)
    expected = kernels.paged_decode(q, to_pair_layout(clean), tables, lens, head_dim**-0.5)
    assert torch.isfinite(got).all() and torch.equal(got, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 4, 128), (4, 2, 32)])
def test_int8_cache_quantizes_each_row_and_attends_like_its_dequantized_values(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """write_kv rounds each token's head row to multiples of max|x| / 127 (half a step at most), and
    paged_attention over the int8 cache (decode rows, fresh prompts, chunks after a prefix) gives the
    attention of those dequantized values, to bf16 precision."""
    kernels = SDPABackend(torch.device("cpu"))._kernels
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    num_blocks, block, max_blocks, num_seqs = 128, 16, 10, 5
    cache = torch.zeros(2, num_blocks, block, num_kv_heads, head_dim + 4, dtype=torch.int8)
    if not kernels.avx512_supports(cache):
        pytest.skip("the int8 cache belongs to the AVX-512 BF16 kernel")
    q_lens = [1, 37, 1, 20, 130]
    lens = torch.tensor([45, 37, 16, 70, 150], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, -1).to(torch.int32)
    slots = torch.cat(
        [
            tables[i, torch.arange(n) // block].long() * block + torch.arange(n) % block
            for i, n in enumerate(lens.tolist())
        ]
    )
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * torch.rand(
        len(slots), num_kv_heads, 1, generator=gen
    )
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    k[3] = 0.0  # a zero row: scale 0, no division by it
    kernels.write_kv(k, v, cache, slots)
    deq = dequantize_int8_cache(cache)
    for half, x in ((0, k), (1, v)):
        step = x.abs().amax(-1, keepdim=True) / 127
        assert ((deq[half].flatten(0, 1)[slots] - x).abs() <= step / 2 + 1e-6).all()
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    got = kernels.paged_attention(q, cache, tables, lens, torch.tensor(starts, dtype=torch.int32), head_dim**-0.5)
    expected = _gathered_reference(q, deq, tables, lens, head_dim**-0.5, starts)
    assert torch.isfinite(got).all()
    # queries and weighted probabilities rounded to int16 steps of their row's max
    assert (got.double() - expected).abs().max().item() < 1e-3  # measured 1.4e-4
    decode = kernels.paged_decode(q[[0, 38]], cache, tables[[0, 2]], lens[[0, 2]], head_dim**-0.5)
    assert torch.equal(decode, got[[0, 38]])
