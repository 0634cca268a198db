"""Read a PEFT LoRA adapter and check it against the base model, before any request uses it.

PEFT stores, for each adapted module of each layer, A [rank, in_features] and B [out_features, rank]
(`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`); the module's output
gains scaling * x @ A.T @ B.T, with scaling = lora_alpha / rank (lora_alpha / sqrt(rank) with
use_rslora). Here each is kept per layer under the checkpoint's module name (q_proj, ..., down_proj), B
already multiplied by the scaling; where the base fuses modules (qkv_proj, gate_up_proj) the update goes
to that module's rows of the fused output.

An adapter may also adapt the embedding (`model.embed_tokens.lora_embedding_{A|B}`: A [rank, vocab],
B [hidden, rank]; a token's embedding gains scaling * A[:, token] @ B.T) and the LM head
(`lm_head.lora_{A|B}.weight`, a linear layer's A [rank, hidden] and B [vocab, rank])."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The modules an adapter may target: each decoder layer's projections, and the embedding and LM head.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD_MODULES = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_HEAD_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.(embed_tokens)\.lora_embedding_([AB])|(lm_head)\.lora_([AB])\.weight)$"
)
# PEFT saves the base model's embedding and LM head beside adapters of them (in case the vocabulary was
# resized): copies of the base's, read from the base model instead.
_BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?:model\.embed_tokens|lm_head)(?:\.base_layer)?\.weight$")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted module of one layer: its update is x @ a.T @ b.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], times the adapter's scaling


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    layers: list[dict[str, LoRAWeights]]  # per decoder layer: module name (q_proj, ...) -> weights
    # The embedding's (a [rank, vocab], b [hidden, rank]) and the LM head's (a [rank, hidden], b [vocab,
    # rank]) under "embed_tokens" and "lm_head", where the adapter adapts them.
    heads: dict[str, LoRAWeights]

    @property
    def nbytes(self) -> int:
        weights = [w for layer in self.layers for w in layer.values()] + list(self.heads.values())
        return sum(w.a.nbytes + w.b.nbytes for w in weights)


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module of the base model (whole, not a rank's shard)."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inter = int(hf_config.intermediate_size)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} does not exist.")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(folder)!r} is not a LoRA adapter: it has no {CONFIG_FILE}.") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg}).") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{path} does not describe a LoRA adapter (peft_type {config.get('peft_type')!r}).")
    return config


def load_adapter(name: str, path: str | Path, hf_config: Any, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter in `path`, checked against the base model (`hf_config`): a ValueError that says what
    is wrong for a missing or malformed adapter, a rank above `max_rank`, target modules the model
    lacks, options this engine does not serve, or weights shaped for another base model."""
    folder = Path(path)
    config = read_adapter_config(folder)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: rank r must be >= 1, got {config.get('r')!r}.")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}; raise it.")
    _check_options(name, config)
    targets = _target_modules(name, config)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing from {str(folder)!r}.")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read ({exc}).") from None
    heads = _heads(name, tensors, hf_config, rank, scaling, dtype)
    layers = _layers(name, tensors, hf_config, rank, scaling, dtype)
    return LoRAAdapter(name, rank, scaling, targets, layers, heads)


def _check_options(name: str, config: dict[str, Any]) -> None:
    unsupported = {
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "layers_to_transform": config.get("layers_to_transform") is not None,
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    found = [option for option, used in unsupported.items() if used]
    if found:
        raise ValueError(f"LoRA adapter {name!r} uses {', '.join(found)}, which this engine does not serve yet.")


def _target_modules(name: str, config: dict[str, Any]) -> frozenset[str]:
    raw = config.get("target_modules") or []
    targets = frozenset([raw] if isinstance(raw, str) else raw)
    unknown = sorted(targets - set(TARGET_MODULES) - set(HEAD_MODULES))
    if unknown:
        raise ValueError(
            f"LoRA adapter {name!r} targets {unknown}, which the model lacks or this engine does not adapt "
            f"(it adapts {', '.join(TARGET_MODULES + HEAD_MODULES)})."
        )
    if not targets:
        raise ValueError(f"LoRA adapter {name!r} names no target_modules.")
    return targets


def _heads(
    name: str, tensors: dict[str, torch.Tensor], hf_config: Any, rank: int, scaling: float, dtype: torch.dtype
) -> dict[str, LoRAWeights]:
    """The embedding's and LM head's weights, taken out of `tensors` (the rest are the layers')."""
    vocab, hidden = int(hf_config.vocab_size), int(hf_config.hidden_size)
    shapes = {"embed_tokens": ((rank, vocab), (hidden, rank)), "lm_head": ((rank, hidden), (vocab, rank))}
    for key in [k for k in tensors if _BASE_COPY.match(k)]:
        if tuple(tensors.pop(key).shape) != (vocab, hidden):
            raise ValueError(
                f"LoRA adapter {name!r} was made for a model with another vocabulary: its {key} is not "
                f"({vocab}, {hidden}); a resized vocabulary is not served."
            )
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for key in [k for k in tensors if _HEAD_KEY.match(k)]:
        match = _HEAD_KEY.match(key)
        assert match is not None
        module, which = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        pieces.setdefault(module, {})[which] = tensors.pop(key)
    heads: dict[str, LoRAWeights] = {}
    for module, ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} lacks its lora {'A' if 'B' in ab else 'B'}.")
        a, b = ab["A"], ab["B"]
        if (tuple(a.shape), tuple(b.shape)) != shapes[module]:
            raise ValueError(
                f"LoRA adapter {name!r} was made for another base model: its {module} has A {tuple(a.shape)} "
                f"and B {tuple(b.shape)}, this model needs {shapes[module][0]} and {shapes[module][1]} "
                f"(vocabulary {vocab}, hidden size {hidden})."
            )
        heads[module] = LoRAWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return heads


def _layers(
    name: str, tensors: dict[str, torch.Tensor], hf_config: Any, rank: int, scaling: float, dtype: torch.dtype
) -> list[dict[str, LoRAWeights]]:
    num_layers = int(hf_config.num_hidden_layers)
    shapes = module_shapes(hf_config)
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} has no place in this model.")
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} does not exist (the model has {num_layers}).")
        pieces.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(num_layers)]
    for (layer, module), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'B' in ab else 'B'}.")
        out_features, in_features = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(
                f"LoRA adapter {name!r} was made for another base model: layer {layer} {module} has A "
                f"{tuple(a.shape)} and B {tuple(b.shape)}, this model needs {(rank, in_features)} and "
                f"{(out_features, rank)} (hidden size {hf_config.hidden_size})."
            )
        layers[layer][module] = LoRAWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return layers
