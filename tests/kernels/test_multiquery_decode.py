"""Verification steps (speculative decoding): requests with short multi-token queries, 1 + k tokens after
their cached context, causal within the query. The fused C++ decode stack must compute them exactly as
the layer-by-layer path does, and the layer-by-layer CPU backend's short-query path (one paged-decode
row per token) must match the reference attention. The AVX2 build (TOKENMILL_CPU_ISA=avx2) runs this
file again in a subprocess (the last test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.tiny_models import make_tiny_model
from tokenmill.attention.cpu import SHORT_QUERY_LEN, SDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.pair_layout import cache_row_width
from tokenmill.attention.selector import get_backend
from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.models.fused_decode import FusedDecode, unsupported_reason
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.ops import build
from tokenmill.worker.model_loader import load_model

BLOCK, NUM_BLOCKS = 16, 64

# A verification step: every query length from 1 to 9, in no order, two decode rows among them,
# each after a context of several blocks (one of them ends a block: the query starts a new one).
CONTEXTS = [37, 50, 18, 70, 33, 5, 21, 40, 64, 29]
QUERY_LENS = [4, 1, 9, 2, 6, 3, 8, 1, 5, 7]


def step_metadata(tables: torch.Tensor, computed: list[int], new: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [num_tokens] and metadata of a step feeding request i its tokens computed[i] ..
    computed[i] + new[i] - 1, blocks from its row of tables [num_reqs, max_blocks]."""
    qsl, positions, slots = [0], [], []
    for i, (c, n) in enumerate(zip(computed, new)):
        qsl.append(qsl[-1] + n)
        positions += range(c, c + n)
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(c, c + n)]
    seq_lens = [c + n for c, n in zip(computed, new)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), meta


def scattered_tables(lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """[len(lengths), max_blocks] int32: each request's blocks drawn at random from the pool."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    counts = [-(-n // BLOCK) for n in lengths]
    tables = torch.zeros(len(lengths), max(counts) + 1, dtype=torch.int32)  # + a padding column
    cursor = 0
    for i, count in enumerate(counts):
        tables[i, :count] = perm[cursor : cursor + count].to(torch.int32)
        cursor += count
    return tables


def load_tiny(folder: Path, **precision: str) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    """The model as the engine loads it, with a zeroed KV cache of NUM_BLOCKS blocks bound to each layer."""
    config, source = create_engine_config(EngineArgs(model=str(folder), **precision))
    backend = get_backend(config.attention_backend, torch.device("cpu"))
    model = load_model(config.model, source.folder, backend, "cpu")
    assert isinstance(model, LlamaForCausalLM)
    kv_dtype = config.cache.kv_cache_dtype
    caches = []
    for layer in model.layers:
        attn = layer.self_attn
        width = cache_row_width(attn.head_dim, kv_dtype)
        cache = torch.zeros(2, NUM_BLOCKS, BLOCK, attn.num_kv_heads, width, dtype=getattr(torch, kv_dtype))
        attn.kv_cache = cache
        caches.append(cache)
    return model, caches


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny Llamas by head_dim: 16 (a plain cache everywhere), 32 (the AVX-512 kernel's pair layout)."""
    return {d: make_tiny_model(tmp_path_factory.mktemp(f"llama{d}"), "llama", head_dim=d) for d in (16, 32)}


def _pair_layout(cache: torch.Tensor) -> bool:
    kernels = build.load("paged_decode")
    return kernels is not None and bool(kernels.avx512_supports(cache))


PRECISIONS: list[Any] = [
    pytest.param(16, {"dtype": "float32"}, id="fp32-weights-fp32-cache"),
    pytest.param(16, {"dtype": "bfloat16"}, id="bf16-weights-bf16-cache"),
    pytest.param(16, {"dtype": "bfloat16", "kv_cache_dtype": "float32"}, id="bf16-weights-fp32-cache"),
    pytest.param(32, {"dtype": "bfloat16"}, id="bf16-weights-bf16-cache-d32"),
    pytest.param(32, {"dtype": "bfloat16", "kv_cache_dtype": "int8"}, id="bf16-weights-int8-cache"),
    pytest.param(32, {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"}, id="int8-int8"),
]


@pytest.mark.parametrize("one_region", [True, False], ids=["one-region", "op-by-op"])
@pytest.mark.parametrize(("head_dim", "precision"), PRECISIONS)
def test_fused_stack_matches_layer_by_layer_on_a_verification_step(
    folders: dict[int, Path], head_dim: int, precision: dict[str, str], one_region: bool
) -> None:
    model, caches = load_tiny(folders[head_dim], **precision)
    if caches[0].dtype == torch.int8 and not _pair_layout(caches[0]):
        pytest.skip("an int8 cache needs the AVX-512 BF16 attention kernel, not built here")
    reason = unsupported_reason(model)
    if reason is not None:
        pytest.skip(f"no fused decode stack here: {reason}")
    fused = FusedDecode(model)
    fused._stack = fused._bind(caches)
    if one_region and not fused._stack.one_region:
        pytest.skip("one parallel region needs the AVX-512 kernels and a pair-layout cache")
    fused._stack.one_region = one_region

    gen = torch.Generator().manual_seed(0)
    tables = scattered_tables([c + n for c, n in zip(CONTEXTS, QUERY_LENS)], gen)
    with torch.inference_mode():
        positions, meta = step_metadata(tables, [0] * len(CONTEXTS), CONTEXTS)  # the contexts, layer by layer
        model(torch.randint(0, 512, positions.shape, generator=gen), positions, meta)
        before = [c.clone() for c in caches]
        positions, meta = step_metadata(tables, CONTEXTS, QUERY_LENS)
        input_ids = torch.randint(0, 512, positions.shape, generator=gen)
        want = model(input_ids, positions, meta).clone()  # [num_tokens, hidden]
        want_caches = [c.clone() for c in caches]
        for cache, old in zip(caches, before):
            cache.copy_(old)
        got = fused(input_ids, positions, meta)

    assert got.shape == want.shape == (sum(QUERY_LENS), model.norm.weight.numel())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for cache, want_cache, old in zip(caches, want_caches, before):
        assert torch.equal(cache, want_cache)  # the same bytes into the same slots, nothing else
        assert not torch.equal(cache, old)


def test_fused_stack_refuses_a_query_past_its_limit(folders: dict[int, Path]) -> None:
    model, caches = load_tiny(folders[16], dtype="float32")
    if unsupported_reason(model) is not None:
        pytest.skip(f"no fused decode stack here: {unsupported_reason(model)}")
    long = FusedDecode.MAX_QUERY_LEN + 1
    tables = scattered_tables([20 + long, 21], torch.Generator().manual_seed(1))
    positions, meta = step_metadata(tables, [20, 20], [long, 1])
    assert build.load("decode_stack").DecodeStack.max_query_len == FusedDecode.MAX_QUERY_LEN
    with torch.inference_mode(), pytest.raises(RuntimeError, match=f"{long} query tokens"):
        FusedDecode(model)(torch.zeros_like(positions), positions, meta)


class _CountingKernels:
    """The backend's C++ kernels, recording the row count of each paged_decode call."""

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels
        self.paged_decode_rows: list[int] = []

    def paged_decode(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
        self.paged_decode_rows.append(q.shape[0])
        return self._kernels.paged_decode(q, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_short_queries_take_one_paged_decode_call_and_match_the_reference(
    cache_dtype: torch.dtype, head_dim: int
) -> None:
    """Requests of 1..9 query tokens attend as rows of one C++ paged-decode call (each row its own
    causal context); a longer chunk after a cached prefix still goes to SDPA."""
    heads, kv_heads = 8, 2
    contexts, query_lens = [*CONTEXTS, 30], [*QUERY_LENS, SHORT_QUERY_LEN + 12]
    gen = torch.Generator().manual_seed(2)
    tables = scattered_tables([c + n for c, n in zip(contexts, query_lens)], gen)
    _, meta = step_metadata(tables, contexts, query_lens)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=gen).to(cache_dtype)
    if _pair_layout(cache):
        pytest.skip("this cache goes to the AVX-512 paged_attention kernel (tests/kernels/test_attention.py)")
    backend = SDPABackend(torch.device("cpu"))
    assert backend._kernels is not None, "the C++ paged-decode kernel could not be built"
    counting = _CountingKernels(backend._kernels)
    backend._kernels = counting
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(meta.num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    ref_cache = cache.clone()
    scale = head_dim**-0.5
    expected = get_backend("torch_ref", torch.device("cpu")).forward(q, k, v, ref_cache, meta, scale)
    got = backend.forward(q, k, v, cache, meta, scale)

    assert counting.paged_decode_rows == [sum(QUERY_LENS)]
    assert torch.equal(cache, ref_cache)
    # The reference and the kernel read the same (cache-rounded) keys and values; the long chunk's
    # SDPA reads its own k, v unrounded.
    short = sum(QUERY_LENS)
    torch.testing.assert_close(got[:short], expected[:short], rtol=0, atol=1e-5)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[short:], expected[short:], rtol=0, atol=tol)


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
