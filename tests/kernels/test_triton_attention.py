"""The Triton attention kernels equal the pure-PyTorch reference (tokenmill.attention.torch_ref).

Without a GPU the kernels run on CPU tensors in Triton's interpreter, with tiny shapes and tiles
(16 x 16) so that every loop, mask and split boundary is crossed. With CUDA the same tests run
compiled on the GPU, plus the GPU-only ones at the end (bf16, real model shapes, default tiles)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

from tests.kernels.triton_env import ON_GPU, interpreter_env, skip_unless_interpretable
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchRefBackend
from tokenmill.attention.torch_ref import write_kv as ref_write_kv

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed: `pip install -e '.[gpu]'` to run the Triton kernel tests", allow_module_level=True
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _import_kernels() -> dict[str, ModuleType]:
    skip_unless_interpretable()
    with interpreter_env():
        return {
            n: importlib.import_module(f"tokenmill.attention.triton.{n}")
            for n in ("kv_write", "prefill", "decode", "backend")
        }


@pytest.fixture(autouse=True, scope="module")
def _interpret_during_tests() -> Iterator[None]:
    with interpreter_env():
        yield


K = _import_kernels()
TritonBackend = K["backend"].TritonBackend
# Tiny tiles so that small contexts still span several key tiles and query blocks.
SMALL_PREFILL = K["prefill"].PrefillTiles(block_m=16, block_n=16)
SMALL_DECODE = K["decode"].DecodeTiles(block_n=16)
BLOCK_SIZE = 16
SCALE = 0.3


class PagedBatch(NamedTuple):
    q: torch.Tensor  # [num_tokens, Hq, D]
    k: torch.Tensor  # [num_tokens, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, BLOCK_SIZE, Hkv, D], random "cached prefix" contents
    meta: AttentionMetadata


def paged_batch(
    query_lens: list[int],
    num_computed: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Requests whose first num_computed tokens sit in the cache (blocks shuffled, so paging matters)
    and whose next query_lens tokens are this step's."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(num_computed, query_lens)]
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    slots: list[int] = []
    for i, (n_blocks, c, n) in enumerate(zip(blocks_per_req, num_computed, query_lens)):
        table = [free.pop() for _ in range(n_blocks)]
        block_tables[i, :n_blocks] = torch.tensor(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    num_tokens = qsl[-1]
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim),
        meta=meta,
    )


def assert_matches_reference(batch: PagedBatch, backend: object, atol: float = 1e-5) -> None:
    """Output and cache after the step equal the reference backend's."""
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TorchRefBackend().forward(batch.q, batch.k, batch.v, ref_cache, batch.meta, SCALE)
    out = backend.forward(batch.q, batch.k, batch.v, cache, batch.meta, SCALE)  # type: ignore[attr-defined]
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)


def small_backend(num_splits: int | None = None) -> object:
    return TritonBackend(DEVICE, num_splits=num_splits, prefill_tiles=SMALL_PREFILL, decode_tiles=SMALL_DECODE)


# ---------------------------------------------------------------------------- KV write
def test_write_kv_scatters_rows_to_their_slots_like_the_reference() -> None:
    batch = paged_batch([5, 20], [0, 11])
    expected, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    ref_write_kv(batch.k, batch.v, expected, batch.meta.slot_mapping)
    K["kv_write"].write_kv(batch.k, batch.v, cache, batch.meta.slot_mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_write_kv_skips_rows_with_a_negative_slot() -> None:
    batch = paged_batch([6], [0])
    slots = batch.meta.slot_mapping.clone()
    slots[[1, 4]] = -1  # padding rows, as a CUDA graph's spare batch rows
    cache = batch.kv_cache.clone()
    K["kv_write"].write_kv(batch.k, batch.v, cache, slots)
    expected = batch.kv_cache.clone()
    keep = slots >= 0
    ref_write_kv(batch.k[keep], batch.v[keep], expected, slots[keep])
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_write_kv_reads_strided_k_and_v() -> None:
    # In the model, k and v are column slices of the fused qkv projection.
    batch = paged_batch([7], [3])
    qkv = torch.randn(7, 3 * 2 * 32, device=DEVICE)
    k = qkv[:, 64:128].view(7, 2, 32)
    v = qkv[:, 128:].view(7, 2, 32)
    expected, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    ref_write_kv(k, v, expected, batch.meta.slot_mapping)
    K["kv_write"].write_kv(k, v, cache, batch.meta.slot_mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------- prefill / extend
def test_prefill_of_fresh_prompts_of_uneven_lengths() -> None:
    assert_matches_reference(paged_batch([5, 33, 16], [0, 0, 0]), small_backend())


def test_chunked_prefill_after_a_cached_prefix() -> None:
    # Prefix lengths on and off block boundaries (prefix-cache hits are whole blocks; chunks are not).
    assert_matches_reference(paged_batch([12, 20], [32, 17]), small_backend())


def test_mixed_batch_of_prompt_chunks_and_decode_rows() -> None:
    assert_matches_reference(paged_batch([1, 9, 1, 18], [40, 7, 3, 0]), small_backend())


def test_a_mixed_steps_leading_decode_rows_take_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    decode = K["backend"].decode_attention

    def recording(q: torch.Tensor, *args: object) -> None:
        calls.append(q.shape[0])
        decode(q, *args)

    monkeypatch.setattr(K["backend"], "decode_attention", recording)
    batch = paged_batch([1, 1, 1, 9, 1, 18], [40, 3, 17, 7, 3, 0])
    assert batch.meta.num_leading_decodes == 3
    assert_matches_reference(batch, small_backend(num_splits=2))
    assert calls == [3]  # the decode row after the prompt chunk goes with the prompts
    calls.clear()
    assert_matches_reference(paged_batch([9, 1, 18], [7, 3, 0]), small_backend())
    assert calls == []


def test_prefill_with_uneven_gqa_group_and_head_dim() -> None:
    # 6 query heads on 2 KV heads (groups of 3 do not divide the 16-row tile), head_dim 24 (padded to 32).
    batch = paged_batch([5, 19], [0, 21], num_heads=6, num_kv_heads=2, head_dim=24)
    assert_matches_reference(batch, small_backend())


def test_prefill_in_fp16() -> None:
    assert_matches_reference(paged_batch([1, 17], [30, 5], dtype=torch.float16), small_backend(), atol=2e-3)


# ---------------------------------------------------------------------------- decode (split-K)
def test_decode_with_one_split() -> None:
    assert_matches_reference(paged_batch([1, 1, 1], [40, 3, 70]), small_backend(num_splits=1))


def test_decode_with_several_splits_including_empty_ones() -> None:
    # 4 splits: the 71-token context spans 2 tiles per split; the 4-token one leaves 3 splits empty.
    assert_matches_reference(paged_batch([1, 1, 1], [40, 3, 70]), small_backend(num_splits=4))


def test_decode_with_splits_fixed_for_a_longer_max_len_is_still_exact() -> None:
    # What a CUDA graph does: the split count is chosen once for max_model_len, contexts are shorter.
    assert_matches_reference(paged_batch([1, 1], [5, 33]), small_backend(num_splits=32))


def test_decode_with_mha_and_with_a_wide_gqa_group() -> None:
    assert_matches_reference(paged_batch([1, 1], [20, 50], num_heads=3, num_kv_heads=3), small_backend(2))
    assert_matches_reference(paged_batch([1, 1], [20, 50], num_heads=8, num_kv_heads=1), small_backend(2))


def test_decode_in_fp16() -> None:
    batch = paged_batch([1, 1], [37, 64], dtype=torch.float16)
    assert_matches_reference(batch, small_backend(num_splits=2), atol=2e-3)


def test_split_count_fills_the_gpu_but_never_splits_short_contexts() -> None:
    choose = K["decode"].choose_num_splits  # (num_seqs, num_kv_heads, max_seq_len, num_sms)
    assert choose(1, 8, 100, num_sms=132) == 1  # one short context: nothing worth splitting
    assert choose(256, 8, 4096, num_sms=132) == 1  # the batch alone fills the GPU
    assert choose(4, 8, 4096, num_sms=132) == 16  # 4096 / 16 = 256 tokens a split, 512 programs
    assert choose(1, 8, 32768, num_sms=132) == K["decode"].MAX_SPLITS


def test_backend_with_default_tiles_and_split_heuristic() -> None:
    backend = TritonBackend(DEVICE)  # 128-row prefill tiles, 64-key tiles, splits from the heuristic
    assert_matches_reference(paged_batch([1, 40, 1], [300, 9, 20]), backend)
    assert_matches_reference(paged_batch([1, 1], [300, 20]), backend)  # two splits on the interpreter's 8 "SMs"


@pytest.mark.parametrize("window,softcap", [(20, None), (None, 3.0), (20, 3.0)])
@pytest.mark.parametrize("query_lens,num_computed", [([21, 9, 1, 1], [0, 37, 50, 130]), ([1, 1, 1], [4, 30, 70])])
def test_window_and_softcap_layers_match_the_reference(
    window: int | None, softcap: float | None, query_lens: list[int], num_computed: list[int]
) -> None:
    """Gemma's layers: the step's k/v written by the Triton kernel, attention by the PyTorch window path."""
    batch = paged_batch(query_lens, num_computed)
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TorchRefBackend().forward(
        batch.q, batch.k, batch.v, ref_cache, batch.meta, SCALE, sliding_window=window, logit_softcap=softcap
    )
    out = small_backend().forward(  # type: ignore[attr-defined]
        batch.q, batch.k, batch.v, cache, batch.meta, SCALE, sliding_window=window, logit_softcap=softcap
    )
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5, rtol=1e-5)


def test_get_backend_selects_triton_by_name() -> None:
    from tokenmill.attention.selector import get_backend

    assert get_backend("triton", DEVICE).name == "triton"


# ---------------------------------------------------------------------------- GPU only
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_default_tiles_on_a_llama_8b_shaped_mixed_batch(dtype: torch.dtype) -> None:
    batch = paged_batch(
        [1, 300, 1, 77, 1], [2000, 0, 513, 1024, 31], num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype
    )
    assert_matches_reference(batch, TritonBackend(DEVICE), atol=2e-2)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_default_split_heuristic_on_long_decode_contexts(dtype: torch.dtype) -> None:
    batch = paged_batch([1] * 4, [4000, 17, 9000, 640], num_heads=16, num_kv_heads=8, head_dim=128, dtype=dtype)
    assert_matches_reference(batch, TritonBackend(DEVICE), atol=2e-2 if dtype == torch.bfloat16 else 1e-4)


@gpu_only
def test_gpu_auto_backend_is_triton_on_cuda() -> None:
    from tokenmill.attention.selector import get_backend

    assert get_backend("auto", DEVICE).name == "triton"
