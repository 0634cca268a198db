"""Sliding-window attention and score soft-capping (Gemma): the reference against HF's own mask rule and
eager attention, every backend against the reference, and window layers never reading dropped blocks."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from tests.kernels.test_attention import BLOCK, HKV, HQ, D, mixed_batch
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.selector import get_backend
from tokenmill.attention.torch_ref import gather_context

WINDOW, SOFTCAP = 20, 3.0  # the window spans two to three 16-token blocks
CPU = torch.device("cpu")


def batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """test_attention's mixed batch (a prompt, a chunk after a prefix, two decodes), typed."""
    q, k, v, cache, meta = mixed_batch(dtype)
    return q, k, v, cache, cast(AttentionMetadata, meta)


class _HFModule(torch.nn.Module):  # what HF's eager attention reads off its module
    num_key_value_groups = HQ // HKV
    training = False
    head_dim = D


def hf_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, window: int | None) -> torch.Tensor:
    """HF Gemma 2's eager attention with its sliding-window mask: one request, q [q_len, Hq, D] at the last
    q_len positions of a context [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], ctx_k.shape[0]
    q_idx = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
    kv_idx = torch.arange(seq_len).unsqueeze(0)  # [1, seq_len]
    allowed = sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx) if window else kv_idx <= q_idx
    mask = torch.zeros(q_len, seq_len).masked_fill(~allowed, float("-inf"))
    out, _ = eager_attention_forward(
        _HFModule(),
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
        ctx_k.transpose(0, 1).unsqueeze(0),
        ctx_v.transpose(0, 1).unsqueeze(0),
        mask,
        scaling=D**-0.5,
        softcap=SOFTCAP,
    )
    return out[0]  # [q_len, Hq, D]


@pytest.mark.parametrize("window", [WINDOW, None])
def test_reference_matches_hf_eager_attention(window: int | None) -> None:
    q, k, v, cache, meta = batch(torch.float32)
    got = get_backend("torch_ref", CPU).forward(
        q, k, v, cache, meta, D**-0.5, sliding_window=window, logit_softcap=SOFTCAP
    )
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        ctx_k, ctx_v = gather_context(cache, meta.block_tables[i], seq_len)
        expected = hf_attention(q[qsl[i] : qsl[i + 1]], ctx_k, ctx_v, window)
        assert torch.allclose(got[qsl[i] : qsl[i + 1]], expected, atol=1e-5)


def test_the_window_and_the_cap_change_the_output() -> None:
    q, k, v, cache, meta = batch(torch.float32)
    ref = get_backend("torch_ref", CPU)
    plain = ref.forward(q, k, v, cache.clone(), meta, D**-0.5)
    windowed = ref.forward(q, k, v, cache.clone(), meta, D**-0.5, sliding_window=WINDOW)
    capped = ref.forward(q, k, v, cache.clone(), meta, D**-0.5, logit_softcap=SOFTCAP)
    assert not torch.allclose(plain, windowed) and not torch.allclose(plain, capped)


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,softcap", [(WINDOW, None), (None, SOFTCAP), (WINDOW, SOFTCAP)])
def test_backends_match_the_reference(
    backend: str, dtype: torch.dtype, tol: float, window: int | None, softcap: float | None
) -> None:
    q, k, v, cache, meta = batch(dtype)
    ref_cache = cache.clone()
    expected = get_backend("torch_ref", CPU).forward(
        q, k, v, ref_cache, meta, D**-0.5, sliding_window=window, logit_softcap=softcap
    )
    got = get_backend(backend, CPU).forward(q, k, v, cache, meta, D**-0.5, sliding_window=window, logit_softcap=softcap)
    assert torch.equal(cache, ref_cache)  # plain layout, the same slots
    assert (got.float() - expected.float()).abs().max().item() < tol


def decode_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Four requests decoding one token each, at context lengths inside, at and past the window."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [5, WINDOW, 40, 131]
    num_blocks = 64
    tables = torch.randperm(num_blocks, generator=gen)[:40].view(4, 10).to(torch.int32)
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)]
    cache = torch.randn(2, num_blocks, BLOCK, HKV, D, generator=gen)
    q = torch.randn(4, HQ, D, generator=gen)
    k, v = torch.randn(2, 4, HKV, D, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        query_start_loc_cpu=list(range(5)),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    return q, k, v, cache, meta


@pytest.mark.parametrize("window,softcap", [(WINDOW, None), (None, SOFTCAP), (WINDOW, SOFTCAP)])
def test_a_decode_step_matches_the_reference(window: int | None, softcap: float | None) -> None:
    q, k, v, cache, meta = decode_batch()
    expected = get_backend("torch_ref", CPU).forward(
        q, k, v, cache.clone(), meta, D**-0.5, sliding_window=window, logit_softcap=softcap
    )
    got = get_backend("cpu", CPU).forward(q, k, v, cache, meta, D**-0.5, sliding_window=window, logit_softcap=softcap)
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("decode", [False, True])
def test_a_window_layer_never_reads_blocks_behind_its_window(decode: bool) -> None:
    """A window layer's freed blocks may be handed to other requests: poison the table entries behind
    every request's window and the output stays the reference's."""
    q, k, v, cache, meta = decode_batch() if decode else batch(torch.float32)
    expected = get_backend("torch_ref", CPU).forward(q, k, v, cache.clone(), meta, D**-0.5, sliding_window=WINDOW)
    poison = min(set(range(cache.shape[1])) - set(meta.block_tables.flatten().tolist()))
    cache[:, poison] = float("nan")
    qsl = meta.query_start_loc_cpu
    tables = meta.block_tables.clone()
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        first_key = max(0, seq_len - (qsl[i + 1] - qsl[i]) - WINDOW + 1)
        tables[i, : first_key // BLOCK] = poison
    assert (tables == poison).any()
    meta.block_tables = tables
    got = get_backend("cpu", CPU).forward(q, k, v, cache, meta, D**-0.5, sliding_window=WINDOW)
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_cpu_backend_refuses_an_int8_cache_for_window_layers() -> None:
    q, k, v, _, meta = batch(torch.float32)
    cache = torch.zeros(2, 64, BLOCK, HKV, D + 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        get_backend("cpu", CPU).forward(q, k, v, cache, meta, D**-0.5, sliding_window=WINDOW)
