"""GGUF files of each architecture llama.cpp writes for our families (llama, Mistral as llama, qwen2,
qwen3, phi3 with its fused tensors and LongRoPE factors, olmo2 with its post-norms), with a mix of F32,
F16, Q8_0 and Q4_0 tensors, load in tokenmill both ways: expanded to a bf16 HF folder, and served in
their own blocks (--quantization gguf). The reference is HF transformers holding the same dequantized
weights (tests/tiny_gguf.py); the embedded model's native Q4_1 against its bf16 expansion:
tests/e2e/test_gguf_default_native_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.tiny_gguf import dequantized_hf_model, write_tiny_gguf
from tests.tiny_models import hf_greedy, make_tiny_model, make_tiny_tokenizer, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.ops import packed_gemm
from tokenmill.quant import GroupedLinear, PackedExperts

FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo2",
    "qwen2-moe",
    "qwen3-moe",
    "mixtral",
    "granitemoe",
    "gemma2",
]
# Metadata that differs from the defaults, so a key read from the wrong place shows.
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "mistral": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),  # head_dim 32 (not 64 / 4)
    "phi3": dict(rms_norm_eps=1e-5),  # LongRoPE, partial rotary (tests/tiny_models.py)
    "olmo2": dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    # experts as ffn_*_exps; Qwen2-MoE's shared expert and dense layer 1; Mixtral as "llama" with experts
    "qwen2-moe": dict(rms_norm_eps=1e-5),
    "qwen3-moe": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mixtral": dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "granitemoe": dict(rms_norm_eps=1e-5),  # its four multipliers as GGUF scales
    # norms stored as 1 + w; the file has no query_pre_attn_scalar (llama.cpp: head_dim)
    "gemma2": dict(query_pre_attn_scalar=32),
}
PROMPTS = random_prompts(6, 3, 30, seed=5)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> tuple[str, Path, Path]:
    """(family, its HF folder, its GGUF file); conversions cached in a temporary TOKENMILL_CACHE."""
    family = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}")
    hf_folder = make_tiny_model(root / "hf", family, **OVERRIDES[family])
    return family, hf_folder, write_tiny_gguf(hf_folder, root / f"{family}.gguf", family)


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield patch


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_expanded_gguf_generates_as_hf_with_the_same_weights(family_gguf: tuple[str, Path, Path]) -> None:
    family, hf_folder, gguf_file = family_gguf
    reference = dequantized_hf_model(hf_folder, rounding=torch.bfloat16)  # the expansion is bf16
    expected = [hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    assert _tokens(LLM(str(gguf_file), dtype="float32", num_kv_blocks=64)) == expected


def test_gguf_metadata_becomes_the_hf_config(family_gguf: tuple[str, Path, Path]) -> None:
    family, hf_folder, gguf_file = family_gguf
    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64)
    ours, original = llm.engine.config.model.hf_config, json.loads((hf_folder / "config.json").read_text())
    assert ours.model_type == original["model_type"]
    assert ours.rope_parameters["rope_theta"] == original["rope_parameters"]["rope_theta"]
    assert ours.rms_norm_eps == original["rms_norm_eps"]
    assert ours.head_dim == (original.get("head_dim") or original["hidden_size"] // original["num_attention_heads"])
    assert ours.tie_word_embeddings == original["tie_word_embeddings"]


def test_gguf_tokenizer_encodes_as_the_original(family_gguf: tuple[str, Path, Path]) -> None:
    family, _, gguf_file = family_gguf
    tokenizer = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64).get_tokenizer()
    original = make_tiny_tokenizer()
    for text in ["The capital of France is Paris.", "Hello world! red, green", "<|im_start|>hi<|im_end|>"]:
        assert tokenizer(text).input_ids == original(text).input_ids
    # llama.cpp's "qwen2" split (Qwen's own) puts every digit in its own token; GPT-2's keeps runs
    digits = tokenizer.convert_ids_to_tokens(tokenizer("12345").input_ids)
    assert digits == (list("12345") if family.startswith("qwen") else original.tokenize("12345"))


@pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")
def test_native_layers_hold_exactly_the_files_weights(family_gguf: tuple[str, Path, Path]) -> None:
    family, hf_folder, gguf_file = family_gguf
    model = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64, quantization="gguf").engine.runner.model
    reference = dict(dequantized_hf_model(hf_folder).named_parameters())
    # MIXED_TYPES: q/k/v (Q4_0, Q4_0, Q8_0; Phi-3's qkv Q4_0) and gate/up (Q4_0, Q8_0; Phi-3's Q8_0)
    # fused, down Q4_0; o_proj F16 stays float
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        if family == "phi3":  # fused in the checkpoint, the file and our layers alike
            qkv = reference[f"{prefix}.self_attn.qkv_proj.weight"]
            gate_up = reference[f"{prefix}.mlp.gate_up_proj.weight"]
        else:
            qkv = torch.cat([reference[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
            gate_up = None
        assert torch.equal(layer.self_attn.qkv_proj.dequantize(), qkv)
        if hasattr(layer.mlp, "experts"):  # every expert of the layer in the file's blocks, one C++ call
            assert isinstance(layer.mlp.experts, PackedExperts) and layer.mlp.experts.kind == "int4"
            continue
        if gate_up is None:
            gate_up = torch.cat([reference[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(layer.mlp.gate_up_proj.dequantize(), gate_up)
        assert torch.equal(layer.mlp.down_proj.dequantize(), reference[f"{prefix}.mlp.down_proj.weight"])
        assert not isinstance(layer.self_attn.o_proj, GroupedLinear)
        if family == "qwen2":
            bias = torch.cat([reference[f"{prefix}.self_attn.{p}_proj.bias"] for p in "qkv"])
            assert torch.equal(layer.self_attn.qkv_proj.bias[: bias.numel()], bias)
    # the Q8_0 embedding: a float lookup, and the tied head in its blocks
    assert isinstance(model.embed_tokens, nn.Embedding)
    assert torch.equal(model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    if family == "qwen2":
        assert torch.equal(model.lm_head.dequantize(), reference["model.embed_tokens.weight"])


@pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")
def test_native_gguf_next_tokens_agree_with_hf(family_gguf: tuple[str, Path, Path]) -> None:
    """Teacher-forced (one difference cannot snowball) over the prompts and HF's greedy continuations:
    the kernels quantize activations to int8 groups, which flips the tiny random model's near-ties
    (top-2 gaps ~0.1) at a few percent of positions, as for int4 (tests/e2e/test_int4_e2e.py)."""
    _, hf_folder, gguf_file = family_gguf
    reference = dequantized_hf_model(hf_folder)
    sequences = [p + hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    with torch.inference_mode():
        want = [reference(torch.tensor([s])).logits[0, :-1].argmax(-1).tolist() for s in sequences]
    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64, quantization="gguf")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    got = [
        [max(entry.items(), key=lambda item: item[1].logprob)[0] for entry in (out.prompt_logprobs or [])[1:] if entry]
        for out in llm.generate(sequences, params, use_tqdm=False)
    ]
    pairs = [(g, w) for got_s, want_s in zip(got, want) for g, w in zip(got_s, want_s, strict=True)]
    assert sum(g == w for g, w in pairs) >= 0.93 * len(pairs)  # measured: 95.3-98.2% over the families


def test_quantization_gguf_needs_a_gguf_file(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "hf", "llama")
    with pytest.raises(ValueError, match="not a .gguf file"):
        create_engine_config(EngineArgs(model=str(folder), quantization="gguf"))


@pytest.mark.timeout(180)  # a broken collective must fail the test, never hang CI
def test_native_gguf_over_two_ranks_equals_one_rank(tmp_path: Path) -> None:
    # Qwen2: fused QKV with biases and a tied Q8_0 head split by rows; o_proj (64 inputs) and down_proj
    # (128) split into whole groups of 32, so each rank quantizes its activations as one rank does.
    hf_folder = make_tiny_model(tmp_path / "hf", "qwen2")
    gguf_file = write_tiny_gguf(hf_folder, tmp_path / "qwen2.gguf", "qwen2")
    tokens = []
    for size in (1, 2):
        llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64, quantization="gguf", tensor_parallel_size=size)
        try:
            tokens.append(_tokens(llm))
        finally:
            llm.engine.shutdown()
    assert tokens[1] == tokens[0]
