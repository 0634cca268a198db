"""Mixture-of-experts specifics (models/moe.py, models/layers/moe.py) against HF transformers on the tiny
MoE families: the router's experts and weights, each layer's sparse block (shared expert included) or
dense MLP, the experts loaded from the names transformers writes (per expert or stacked), the grouped
FusedExperts forward against a per-expert loop, tensor-parallel slices of the expert weights, int8
greedy agreement, structured output with drafts, and the sliding-window guard. Greedy equality with HF
under chunked prefill, preemption and prefix hits: test_hf_equivalence.py, which runs on every family
of tests/tiny_models.py (TP=2 and speculative decoding: test_tensor_parallel.py, test_spec_decode_e2e.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, cast

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.tiny_models import (
    FAMILIES,
    TINY,
    hf_model,
    make_tiny_model,
    make_tiny_tokenizer,
    random_prompts,
    teacher_forced_top_tokens,
)
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.models.layers import moe as moe_layers
from tokenmill.models.layers.moe import FusedExperts, SparseMoeBlock
from tokenmill.models.llama import MLP
from tokenmill.models.moe import MoeForCausalLM, MoeSpec

MOE_FAMILIES = ["qwen2-moe", "qwen3-moe", "mixtral", "granitemoe"]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(HF's model, ours as the engine loaded it) of one tiny MoE family."""
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    ours = LLM(str(folder), dtype="float32", num_kv_blocks=16).engine.runner.model
    return hf_model(folder), ours


def hf_block(hf: Any, layer: int) -> Any:
    decoder = hf.model.layers[layer]
    return decoder.block_sparse_moe if hasattr(decoder, "block_sparse_moe") else decoder.mlp


def hf_routing(hf: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (expert ids, weights) [T, k] for layer 0."""
    block = hf_block(hf, 0)
    router = block.router if hasattr(block, "router") else block.gate  # GraniteMoe's / the others'
    _, weights, ids = router(x)
    return ids, weights.float()


def hidden_states(n: int, size: int) -> torch.Tensor:
    return torch.randn(n, size, generator=torch.Generator().manual_seed(0))  # [n, hidden]


@torch.inference_mode()
def test_router_picks_hf_experts_with_hf_weights(moe_pair: tuple[Any, Any]) -> None:
    hf, ours = moe_pair
    x = hidden_states(64, hf.config.hidden_size)
    want_ids, want_weights = hf_routing(hf, x)
    block = ours.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    got = block.gate.route(x)
    assert torch.equal(got.ids, want_ids)
    torch.testing.assert_close(got.weights, want_weights, atol=1e-6, rtol=0)
    assert got.weights.dtype == torch.float32
    # a real routing: tokens spread over every expert, weights far from uniform
    assert set(got.ids.flatten().tolist()) == set(range(block.experts.num_experts))
    assert (got.weights.max(dim=-1).values - got.weights.min(dim=-1).values).mean() > 0.05


@torch.inference_mode()
def test_sparse_block_equals_hf_with_checkpoint_experts(moe_pair: tuple[Any, Any]) -> None:
    """The routed experts as loaded from the checkpoint's names (and Qwen2-MoE's gated shared expert)."""
    hf, ours = moe_pair
    x = hidden_states(40, hf.config.hidden_size)
    for layer, decoder in enumerate(ours.layers):
        want = hf_block(hf, layer)(x.unsqueeze(0))[0]  # [T, H]
        torch.testing.assert_close(decoder.mlp(x), want, atol=1e-5, rtol=1e-5)
    kinds = [type(decoder.mlp) for decoder in ours.layers]
    if hf.config.model_type == "qwen2_moe":  # mlp_only_layers=[1]; a shared expert in layer 0
        assert kinds == [SparseMoeBlock, MLP] and ours.layers[0].mlp.shared_expert is not None
    else:
        assert kinds == [SparseMoeBlock, SparseMoeBlock]


@pytest.mark.parametrize(("step", "mlp_only"), [(1, [1]), (2, []), (2, [3])])
def test_the_sparse_layers_are_hfs(step: int, mlp_only: list[int]) -> None:
    """decoder_sparse_step and mlp_only_layers pick the MoE layers (the rest are dense) as in HF."""
    from transformers import AutoModelForCausalLM

    spec = TINY | FAMILIES["qwen2-moe"] | dict(num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    hf = AutoModelForCausalLM.from_config(config)
    want = {i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}
    assert MoeSpec.of(config).sparse_layers == want and 0 < len(want) < 4


def restack_experts(folder: Path, dest: Path, gate_up_together: bool) -> Path:
    """The checkpoint with each layer's per-expert tensors stacked, under transformers' own names
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) or GGUF's split (gate_proj, up_proj)."""
    shutil.copytree(folder, dest)
    tensors = load_file(folder / "model.safetensors")
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
    grouped: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = per_expert.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            grouped.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = tensor
    for (prefix, proj), by_expert in grouped.items():
        out[f"{prefix}.{proj}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if gate_up_together:
        for prefix in {prefix for prefix, _ in grouped}:
            out[f"{prefix}.gate_up_proj"] = torch.cat([out.pop(f"{prefix}.gate_proj"), out.pop(f"{prefix}.up_proj")], 1)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("gate_up_together", [True, False])
def test_stacked_expert_checkpoints_give_the_same_tokens(tmp_path: Path, gate_up_together: bool) -> None:
    folder = make_tiny_model(tmp_path / "qwen3-moe", "qwen3-moe")
    stacked = restack_experts(folder, tmp_path / "stacked", gate_up_together)
    prompts = random_prompts(4, 5, 30, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want, got = (
        [
            o.outputs[0].token_ids
            for o in LLM(str(f), dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
        ]
        for f in (folder, stacked)
    )
    assert got == want


def per_expert_loop(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition, one (token, expert) pair at a time."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    i = experts.intermediate_size
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w13, w2 = experts.w13[ids[t, j]].float(), experts.w2[ids[t, j]].float()
            h = F.silu(w13[:i] @ x[t].float()) * (w13[i:] @ x[t].float())
            out[t] += weights[t, j] * (w2 @ h)
    return out


@pytest.mark.parametrize("num_tokens", [1, 8, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_fused_experts_forward_equals_a_per_expert_loop(num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    experts = FusedExperts(num_experts=8, hidden_size=64, intermediate_size=32).to(dtype)
    experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.2)
    experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.2)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(num_tokens)])  # experts 6, 7 idle
    weights = torch.rand(num_tokens, 2, generator=gen)
    want = per_expert_loop(experts, x, ids, weights)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for got in (experts(x, ids, weights), experts.forward_every_expert(x, ids, weights)):  # grouped; graph-safe
        assert got.shape == (num_tokens, 64) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_a_tensor_parallel_rank_loads_its_slice_of_per_expert_and_stacked_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 of 2 keeps intermediate rows [I/2, I) of each expert's gate and up and those columns of its
    down, whether the checkpoint stores one tensor per expert or all experts stacked (GraniteMoe; GGUF)."""
    monkeypatch.setattr(moe_layers, "tp_world_size", lambda: 2)
    monkeypatch.setattr(moe_layers, "tp_rank", lambda: 1)
    num_experts, hidden, inter = 3, 8, 6
    gen = torch.Generator().manual_seed(0)
    gate, up = (
        torch.randn(num_experts, inter, hidden, generator=gen),
        torch.randn(num_experts, inter, hidden, generator=gen),
    )
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    per_expert, stacked, gguf_like = (FusedExperts(num_experts, hidden, inter) for _ in range(3))
    for e in range(num_experts):
        per_expert.weight_loader(per_expert.w13, gate[e], "gate", e)
        per_expert.weight_loader(per_expert.w13, up[e], "up", e)
        per_expert.weight_loader(per_expert.w2, down[e], "down", e)
    stacked.weight_loader(stacked.w13, torch.cat([gate, up], dim=1), "gate_up")
    stacked.weight_loader(stacked.w2, down, "down")
    gguf_like.weight_loader(gguf_like.w13, gate, "gate")  # gate and up stacked apart
    gguf_like.weight_loader(gguf_like.w13, up, "up")
    gguf_like.weight_loader(gguf_like.w2, down, "down")
    want_w13 = torch.cat([gate[:, 3:], up[:, 3:]], dim=1)  # [E, 2 * I/2, H]
    for experts in (per_expert, stacked, gguf_like):
        assert torch.equal(experts.w13.data, want_w13)
        assert torch.equal(experts.w2.data, down[:, :, 3:])
    with pytest.raises(ValueError, match="expert 3 does not exist"):
        per_expert.weight_loader(per_expert.w2, down[0], "down", 3)


def test_int8_greedy_agreement_with_float32(tmp_path: Path) -> None:
    """Teacher-forced greedy tokens (one difference cannot snowball) of int8 weights, the experts' too,
    against float32; the router stays float32. The tiny random models have near-ties that int8's rounding
    flips: measured over 4 prompt sets, 88-94% for the four MoE families and 92-93% for the dense llama
    and qwen2 (the same measure); 88.3% on this set."""
    folder = make_tiny_model(tmp_path / "qwen2-moe", "qwen2-moe")
    prompts = random_prompts(24, 10, 40, seed=0)

    fp32 = teacher_forced_top_tokens(LLM(str(folder), dtype="float32", num_kv_blocks=64), prompts)
    int8_llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, quantization="int8")
    int8 = teacher_forced_top_tokens(int8_llm, prompts)
    assert len(int8) == len(fp32) == sum(len(p) - 1 for p in prompts)
    assert sum(a == b for a, b in zip(int8, fp32)) / len(fp32) >= 0.85
    model: Any = int8_llm.engine.runner.model
    router = model.layers[0].mlp.gate
    assert router.weight.dtype == torch.float32


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path: Path) -> None:
    """Every MoE layer attends to the whole context: within the window that is exact, beyond it wrong."""
    folder = make_tiny_model(tmp_path / "mixtral", "mixtral", sliding_window=64)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"), pytest.raises(ValueError, match="sliding window of 64 tokens.*--max-model-len 64"):
        MoeForCausalLM(config, backend=cast(Any, None), max_position=512)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_structured_output_with_speculative_drafts_follows_the_schema(tmp_path: Path) -> None:
    """A constrained request through GraniteMoe (its logits scaled) with n-gram drafts verified by the
    experts: the JSON parses and validates."""
    folder = make_tiny_model(tmp_path / "granitemoe", "granitemoe")
    make_tiny_tokenizer().save_pretrained(folder)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8}
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, speculative_config=spec)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "age": {"type": "integer", "maximum": 120}},
        "required": ["color", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    for out in llm.generate(["Answer in JSON:", "hello"], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.scheduler.stats.spec.num_draft_tokens > 0
