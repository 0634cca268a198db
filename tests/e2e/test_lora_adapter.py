"""PEFT LoRA adapters read and checked against the base model (tokenmill/lora/adapter.py), with PEFT as
the reference: the base weight plus our scaled B @ A equals PEFT's merged weight for every adapted module;
bad adapters are clear errors at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import hf_model, make_tiny_model
from tokenmill.lora import LoRARequest
from tokenmill.lora.adapter import TARGET_MODULES, load_adapter


def make_adapter(base: Path, dest: Path, seed: int = 0, bf16_exact: bool = False, **lora: Any) -> tuple[Path, Any]:
    """A PEFT adapter on the tiny model in `base` with random non-zero B (PEFT starts B at zero); returns
    its folder and the PEFT model. `bf16_exact`: every A and B value a bf16 one (the fused CPU decode
    stack keeps adapters in bf16: then it holds them exactly). PEFT is imported here, not at collection:
    it imports triton, and the Triton kernel tests must import it first, under TRITON_INTERPRET=1."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    options: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": list(TARGET_MODULES)} | lora
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(**options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:  # the embedding's A starts at zero too
                param.normal_(0, 0.1)
            if bf16_exact and "lora_" in name:
                param.copy_(param.bfloat16().float())
    model.save_pretrained(dest)
    return dest, model


@pytest.mark.parametrize("rslora", [False, True])
def test_base_plus_scaled_update_equals_peft_merged_weights(llama_model: Path, tmp_path: Path, rslora: bool) -> None:
    folder, model = make_adapter(llama_model, tmp_path / "a", use_rslora=rslora)
    hf_config = model.base_model.model.config
    adapter = load_adapter("a", folder, hf_config, max_rank=16, dtype=torch.float32)
    assert adapter.rank == 4 and adapter.scaling == (8 / 2 if rslora else 8 / 4)
    base = hf_model(llama_model)
    merged = model.merge_and_unload()
    for i, layer in enumerate(adapter.layers):
        assert set(layer) == set(TARGET_MODULES)
        for module, weights in layer.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            before = base.get_submodule(f"model.layers.{i}.{part}.{module}").weight
            after = merged.get_submodule(f"model.layers.{i}.{part}.{module}").weight
            torch.testing.assert_close(before + weights.b @ weights.a, after, rtol=1e-5, atol=1e-6)
    assert adapter.nbytes == sum(4 * (out + inn) * 4 for out, inn in _shapes(hf_config)) * hf_config.num_hidden_layers


def test_embedding_and_lm_head_updates_equal_peft_merged_weights(llama_model: Path, tmp_path: Path) -> None:
    folder, model = make_adapter(llama_model, tmp_path / "h", target_modules=["q_proj", "embed_tokens", "lm_head"])
    config = model.base_model.model.config
    adapter = load_adapter("h", folder, config, max_rank=8, dtype=torch.float32)
    assert set(adapter.heads) == {"embed_tokens", "lm_head"}
    assert all(set(layer) == {"q_proj"} for layer in adapter.layers)
    base, merged = hf_model(llama_model), model.merge_and_unload()
    embedding, head = adapter.heads["embed_tokens"], adapter.heads["lm_head"]
    assert embedding.a.shape == (4, config.vocab_size) and embedding.b.shape == (config.hidden_size, 4)
    before, after = base.model.embed_tokens.weight, merged.model.embed_tokens.weight
    torch.testing.assert_close(before + (embedding.b @ embedding.a).t(), after, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(base.lm_head.weight + head.b @ head.a, merged.lm_head.weight, rtol=1e-5, atol=1e-6)
    shrunk = make_tiny_model(tmp_path / "small-vocab", "llama", vocab_size=200)
    with pytest.raises(ValueError, match="another vocabulary"):
        load_adapter("h", folder, hf_model(shrunk).config, max_rank=8, dtype=torch.float32)


def _shapes(hf_config: Any) -> list[tuple[int, int]]:
    from tokenmill.lora.adapter import module_shapes

    return list(module_shapes(hf_config).values())


def test_a_partial_adapter_adapts_only_its_modules(llama_model: Path, tmp_path: Path) -> None:
    folder, model = make_adapter(llama_model, tmp_path / "qv", target_modules=["q_proj", "v_proj"])
    adapter = load_adapter("qv", folder, model.base_model.model.config, max_rank=8, dtype=torch.bfloat16)
    assert adapter.target_modules == {"q_proj", "v_proj"}
    assert all(set(layer) == {"q_proj", "v_proj"} for layer in adapter.layers)
    assert adapter.layers[0]["q_proj"].a.dtype == torch.bfloat16


def test_bad_adapters_are_clear_errors(llama_model: Path, tmp_path: Path) -> None:
    folder, model = make_adapter(llama_model, tmp_path / "ok", r=8)
    config = model.base_model.model.config
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        load_adapter("ok", folder, config, max_rank=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter("gone", tmp_path / "nowhere", config, max_rank=8, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter("empty", tmp_path / "empty", config, max_rank=8, dtype=torch.float32)
    odd, _ = make_adapter(llama_model, tmp_path / "odd", target_modules=["q_proj"])
    settings = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps(settings | {"target_modules": ["q_proj", "score"]}))
    with pytest.raises(ValueError, match="targets \\['score'\\]"):
        load_adapter("odd", odd, config, max_rank=8, dtype=torch.float32)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        load_adapter("broken", broken, config, max_rank=8, dtype=torch.float32)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot be read"):
        load_adapter("broken", broken, config, max_rank=8, dtype=torch.float32)


def test_an_adapter_for_another_base_is_refused(llama_model: Path, tmp_path: Path) -> None:
    wider = make_tiny_model(tmp_path / "wider", "llama", hidden_size=96)
    folder, _ = make_adapter(wider, tmp_path / "w")
    config = hf_model(llama_model).config
    with pytest.raises(ValueError, match="made for another base model"):
        load_adapter("w", folder, config, max_rank=8, dtype=torch.float32)


@pytest.mark.parametrize(("fields", "message"), [({"lora_name": ""}, "non-empty"), ({"lora_int_id": 0}, ">= 1")])
def test_lora_request_checks_its_fields(fields: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/x"} | fields
    with pytest.raises(ValueError, match=message):
        LoRARequest(**values)
