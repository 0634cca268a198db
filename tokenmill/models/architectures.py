"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            return _MODELS[arch]
    by_type = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    arch = by_type.get(getattr(hf_config, "model_type", ""), "")
    if arch:
        return _MODELS[arch]
    raise ValueError(
        f"unsupported architecture {getattr(hf_config, 'architectures', None)}; tokenmill supports {sorted(_MODELS)}."
    )
