"""Architecture name (config.json "architectures") -> model class.

Entries name their module rather than import it, so that asking whether a folder is supported (the
loader, `tokenmill info MODEL`) imports no model code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # hints only: the server reads what an architecture is without torch
    from torch import nn

# architecture -> "module:Class" under tokenmill.models; one file per family
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "moe:MoeForCausalLM",
    "MixtralForCausalLM": "moe:MoeForCausalLM",
    "GraniteMoeForCausalLM": "moe:MoeForCausalLM",
    "Gemma2ForCausalLM": "gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "gemma:GemmaForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    # The causal LM's body with a `score` head on the last token (no LM head): pooling requests only.
    "LlamaForSequenceClassification": "classifier:LlamaForSequenceClassification",
    "MistralForSequenceClassification": "classifier:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "classifier:LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": "classifier:LlamaForSequenceClassification",
}

# config.json "model_type" -> architecture, for configs that name no architecture
_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


# Architectures whose model runs one pipeline stage's layers (LlamaForCausalLM.forward_stage).
_PIPELINE_STAGES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}
)


def supports_pipeline(hf_config: Any) -> str | None:
    """None where the model runs in pipeline stages, else what it is (for an error message)."""
    arch = architecture_of(hf_config)
    if arch in _PIPELINE_STAGES:
        return None
    return f"the {arch} architecture (pipeline stages run {', '.join(sorted(_PIPELINE_STAGES))})"


def is_classifier(hf_config: Any) -> bool:
    """Whether the config's model is a *ForSequenceClassification one: it scores, never generates."""
    return (architecture_of(hf_config) or "").endswith("ForSequenceClassification")


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_of(hf_config: Any) -> str | None:
    """The supported architecture a config names (by "architectures", else by "model_type"), or None."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            return str(arch)
    return _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", "") or "")


def unsupported_message(hf_config: Any) -> str:
    named = getattr(hf_config, "architectures", None) or getattr(hf_config, "model_type", None)
    return f"unsupported architecture {named}; tokenmill supports {', '.join(supported_architectures())}."


def model_class(hf_config: Any) -> type[nn.Module]:
    arch = architecture_of(hf_config)
    if arch is None:
        raise ValueError(unsupported_message(hf_config))
    module_name, _, class_name = _MODELS[arch].partition(":")
    cls: type[nn.Module] = getattr(importlib.import_module(f"tokenmill.models.{module_name}"), class_name)
    return cls
