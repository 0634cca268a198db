"""int4 weights in whole models: every linear layer and the head swapped, logits against the same model
run in fp32 with the int4-dequantized weights (the only difference left is the int8 quantization of
the activations), greedy agreement, and the fused decode stack against the layer-by-layer path (also
with the other grouped kinds GGUF files bring: 8 bits, float32 params, groups of 16)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import cycle
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.kernels.grouped_weights import rounded_grouped
from tests.tiny_models import make_tiny_model, random_prompts, teacher_forced_top_tokens
from tokenmill import LLM, SamplingParams
from tokenmill.ops import packed_gemm
from tokenmill.quant import GroupedLinear, Int4Linear, swap_linears

pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")

PROMPTS = random_prompts(20, 5, 40, seed=4)


def int4_llm(folder: Path, group_size: int = 32, zero_point: bool = False, **kwargs: object) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        num_kv_blocks=256,
        quantization="int4",
        quantization_group_size=group_size,
        quantization_zero_point=zero_point,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")  # tied embeddings, QKV bias


def test_every_linear_and_the_tied_head_are_int4_and_the_embedding_stays_float(tied_model: Path) -> None:
    model = int4_llm(tied_model).engine.runner.model
    assert not [name for name, m in model.named_modules() if type(m) is not Int4Linear and isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, Int4Linear) and model.embed_tokens.weight.dtype == torch.float32
    assert len([m for m in model.modules() if isinstance(m, Int4Linear)]) == 4 * len(model.layers) + 1
    # the head is a quantized copy of the embedding (4 bits: ~8% error on these Gaussian weights)
    error = (model.lm_head.dequantize() - model.embed_tokens.weight).norm() / model.embed_tokens.weight.norm()
    assert error < 0.1


@contextmanager
def float_linears() -> Iterator[None]:
    """Load a float32 model with its linear layers left as nn.Linear: an AVX2 build packs them into
    Fp32Linear panels at load (the same arithmetic), and these tests overwrite or swap nn.Linear layers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_gemm, "isa", lambda: "scalar")
        yield


def dequantized_twin(folder: Path, int4: LLM) -> LLM:
    """The same model in fp32 with each linear layer's weight replaced by the int4 model's dequantized one."""
    with float_linears():
        twin = LLM(str(folder), dtype="float32", num_kv_blocks=256, enforce_eager=True)
    quantized = dict(int4.engine.runner.model.named_modules())
    with torch.no_grad():
        for name, module in twin.engine.runner.model.named_modules():
            if isinstance(module, nn.Linear):
                source = quantized[name]
                assert isinstance(source, Int4Linear)
                module.weight.copy_(source.dequantize())
    return twin


@pytest.mark.parametrize("group_size,zero_point", [(32, False), (128, True)])  # 128: hidden 64 is padded
def test_int4_logits_and_greedy_tokens_follow_the_dequantized_fp32_model(
    llama_model: Path, group_size: int, zero_point: bool
) -> None:
    """Teacher-forced logprobs (one difference cannot snowball) within the int8 activation rounding,
    and greedy tokens: the first of each of 20 prompts, and the next token at every position of the
    prompts and of the fp32 model's 16-token continuations. The tiny random model has near-ties
    (top-2 gaps ~0.1), which that rounding flips at a few percent of positions."""
    int4 = int4_llm(llama_model, group_size, zero_point, kv_cache_dtype="float32")
    twin = dequantized_twin(llama_model, int4)
    teacher = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got, want = (llm.generate(PROMPTS, teacher, use_tqdm=False) for llm in (int4, twin))
    diffs = [
        abs(a[token].logprob - b[token].logprob)
        for prompt, w, g in zip(PROMPTS, want, got)
        for token, a, b in zip(prompt, w.prompt_logprobs or [], g.prompt_logprobs or [])
        if a is not None and b is not None
    ]
    assert len(diffs) == sum(len(p) - 1 for p in PROMPTS)
    assert sum(diffs) / len(diffs) < 0.06 and max(diffs) < 0.3  # measured: mean 0.036, max 0.17
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    continuations = [out.outputs[0].token_ids for out in twin.generate(PROMPTS, greedy, use_tqdm=False)]
    firsts = [out.outputs[0].token_ids[0] for out in int4.generate(PROMPTS, greedy, use_tqdm=False)]
    assert sum(a == b[0] for a, b in zip(firsts, continuations)) >= 19  # measured: 19 and 20 of 20
    sequences = [p + c for p, c in zip(PROMPTS, continuations)]
    got_top, want_top = teacher_forced_top_tokens(int4, sequences), teacher_forced_top_tokens(twin, sequences)
    assert len(got_top) == len(want_top) == sum(len(s) - 1 for s in sequences)
    agreement = sum(a == b for a, b in zip(got_top, want_top)) / len(want_top)
    assert agreement >= 0.93  # measured: 95.1% and 95.4% (94-96% over other seeds and settings)


@pytest.mark.parametrize("head_dim", [16, 32])  # 32: one parallel region per step (AVX-512 attention)
@pytest.mark.parametrize("group_size,zero_point", [(32, True), (128, False)])
def test_fused_decode_with_int4_layers_matches_layer_by_layer(
    tmp_path: Path, head_dim: int, group_size: int, zero_point: bool
) -> None:
    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=head_dim)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompts = PROMPTS[:5]
    fused = int4_llm(folder, group_size, zero_point, max_num_batched_tokens=16)
    eager = int4_llm(folder, group_size, zero_point, max_num_batched_tokens=16, enforce_eager=True)
    assert fused.engine.runner.fused_decode_off_reason is None
    got = fused.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    stack = fused.engine.runner.fused_decode._stack
    assert stack is not None  # the stack ran
    if head_dim == 32 and fused.engine.runner.backend.serves_int8_cache(16, 2, 32):  # type: ignore[attr-defined]
        assert stack.one_region  # the int4 GEMMs ran inside the step's one parallel region
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in w_step.items():
                assert g_step[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


# Q6_K's kind, Q4_K's, an 8-bit layer with minimums (a fused layer promoted to 8 bits), Q8_0's
GGUF_LIKE_KINDS = [
    (8, torch.float32, False, 16),
    (4, torch.float32, True, 32),
    (8, torch.float32, True, 16),
    (8, torch.float16, False, 32),
]


def grouped_llm(folder: Path, **kwargs: object) -> LLM:
    """The float32 model with its linear layers (qkv, o, gate_up, down in turn) and head rounded into
    the GGUF-like kinds, cycling through them."""
    with float_linears():
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16, **kwargs)
    kinds = cycle(GGUF_LIKE_KINDS)
    swap_linears(
        llm.engine.runner.model,
        lambda w, bias, _: GroupedLinear(rounded_grouped(w, *next(kinds)), w.shape[1], bias, kernel="cpu"),
    )
    return llm


def test_fused_decode_with_8_bit_and_float32_param_layers_matches_layer_by_layer(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=32)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompts = PROMPTS[:5]
    fused, eager = grouped_llm(folder), grouped_llm(folder, enforce_eager=True)
    layer = fused.engine.runner.model.layers[0]
    assert [layer.self_attn.qkv_proj.bits, layer.self_attn.o_proj.bits] == [8, 4]
    fused.engine.runner.fused_decode._stack = None  # bound again, to the swapped layers, on the next step
    assert fused.engine.runner.fused_decode_off_reason is None
    got = fused.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert fused.engine.runner.fused_decode._stack is not None  # the stack ran
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in w_step.items():
                assert g_step[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
