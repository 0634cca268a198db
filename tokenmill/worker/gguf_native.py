"""``--quantization gguf``: a .gguf model's linear layers, LM head and experts served in the file's own
blocks.

`attach_gguf_linears` runs on the model while it is still on the meta device: each linear layer whose
checkpoint tensors are all quantized becomes a GroupedLinear built from the file's blocks (repacked
exactly, quant/gguf.py), so their float expansion is never allocated. The other tensors (embedding,
norms, float linear layers) then load through the model's weight loaders as for any checkpoint.

Under tensor parallelism each rank keeps what the float layer would: column-parallel layers (fused
QKV, gate/up, the vocabulary-split head) their rows, taken by the layer's own weight loader from the
levels, scales and minimums alike (a row is a whole output channel); row-parallel layers (o_proj,
down_proj) their slice of the input columns, which must hold whole groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from tokenmill.distributed.parallel_state import tp_world_size
from tokenmill.loader.gguf_weights import GGUFWeights
from tokenmill.models.layers.linear import RowParallelLinear
from tokenmill.models.layers.moe import FusedExperts
from tokenmill.models.llama import STACKED_PARAMS
from tokenmill.ops import moe as moe_ops
from tokenmill.quant import GroupedLinear, GroupedWeight, PackedExperts, keep_layout_attributes
from tokenmill.quant.gguf import common_format

# our fused layer -> the checkpoint projections stacked in it and their shard ids, in row order
_FUSED: dict[str, list[tuple[str, str | int]]] = {}
for _piece, _fused, _shard_id in STACKED_PARAMS:
    _FUSED.setdefault(_fused, []).append((_piece, _shard_id))


def attach_gguf_linears(model: nn.Module, weights: GGUFWeights, device: str) -> set[str]:
    """Swap the meta model's quantized linear layers (and its LM head, the tied embedding's blocks
    where the file has no output.weight) for GroupedLinear modules on `device`; returns the checkpoint
    names they consumed, which the float loading must skip. A layer with a float part stays float."""
    consumed: set[str] = set()
    targets = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path, linear in targets:
        parts = _checkpoint_parts(path)
        if not all(weights.is_quantized(f"{part}.weight") for part, _ in parts):
            continue
        _replace(model, path, _grouped_linear(weights, linear, parts, linear.out_features, device), linear)
        consumed.update(name for part, _ in parts for name in (f"{part}.weight", f"{part}.bias") if name in weights)
    consumed |= _attach_packed_experts(model, weights, device)
    if getattr(model, "lm_head", False) is None and weights.is_quantized("model.embed_tokens.weight"):
        # Tied: the head multiplies by the embedding's blocks (this rank's vocabulary rows, as the
        # embedding's loader takes them); the lookup still takes float rows.
        embedding = model.get_submodule("embed_tokens")
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"{type(model).__name__} ties its head to an embedding it does not name embed_tokens")
        parts = [("model.embed_tokens", None)]
        model.lm_head = _grouped_linear(weights, embedding, parts, embedding.num_embeddings, device)
    return consumed


def _attach_packed_experts(model: nn.Module, weights: GGUFWeights, device: str) -> set[str]:
    """Swap each FusedExperts whose ffn_*_exps are all quantized for PackedExperts built from their
    blocks (every expert of a layer in one C++ call); returns the names consumed. On one CPU rank only:
    elsewhere the experts load expanded to float (their blocks dequantized), as do float expert tensors."""
    if device != "cpu" or tp_world_size() > 1 or not moe_ops.available():
        return set()
    consumed: set[str] = set()
    for path, experts in [(p, m) for p, m in model.named_modules() if isinstance(m, FusedExperts)]:
        names = [f"model.{path}.{piece}" for piece in ("gate_proj", "up_proj", "down_proj")]
        if not all(name in weights and weights.is_quantized(name) for name in names):
            continue
        gate, up, down = (weights.grouped_experts(name) for name in names)
        packed = PackedExperts.from_grouped(gate, up, down, experts.hidden_size, experts.intermediate_size)
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, packed)
        consumed.update(names)
    return consumed


def _checkpoint_parts(path: str) -> list[tuple[str, str | int | None]]:
    """Our module path -> its checkpoint tensors' prefixes and shard ids (layers.0.self_attn.qkv_proj
    -> (model.layers.0.self_attn.q_proj, "q"), ...; lm_head -> (lm_head, None))."""
    if path == "lm_head":
        return [("lm_head", None)]
    parent, _, name = path.rpartition(".")
    return [(f"model.{parent}.{piece}", shard_id) for piece, shard_id in _FUSED.get(name, [(name, None)])]


def _grouped_linear(
    weights: GGUFWeights,
    owner: nn.Module,
    parts: list[tuple[str, str | int | None]],
    out_features: int,
    device: str,
) -> GroupedLinear:
    """This rank's GroupedLinear of `parts`, sliced as `owner` (the float module it replaces) slices."""
    full = common_format([weights.grouped(f"{part}.weight") for part, _ in parts])
    shard_ids = [shard_id for _, shard_id in parts]
    if isinstance(owner, RowParallelLinear):
        weight, in_features = _input_slice(full[0], owner)
    else:  # the owner's loader picks this rank's rows: [out (this rank), ...] per component
        minimums = [p.minimums for p in full if p.minimums is not None]  # all of them, or none
        weight = GroupedWeight(
            _rows(owner, [p.levels for p in full], shard_ids, out_features),
            _rows(owner, [p.scales for p in full], shard_ids, out_features),
            _rows(owner, minimums, shard_ids, out_features) if minimums else None,
            full[0].bits,
        )
        in_features = full[0].levels.shape[1]
    bias = None
    if any(f"{part}.bias" in weights for part, _ in parts):  # Qwen2's q, k and v
        biases = [
            weights.float_tensor(f"{part}.bias") if f"{part}.bias" in weights else torch.zeros(g.levels.shape[0])
            for (part, _), g in zip(parts, full)
        ]
        bias = _rows(owner, biases, shard_ids, out_features)  # [out], this rank's
    # The C++ kernel on a CPU; elsewhere the reference (dequantize, then a float GEMM) on the device.
    kernel = None if device == "cpu" else "reference"
    return GroupedLinear(weight, in_features, bias, kernel).to(device)


def _rows(
    owner: nn.Module, tensors: list[torch.Tensor], shard_ids: list[str | int | None], out_features: int
) -> torch.Tensor:
    """The owner's weight loader applied to each part: this rank's rows of their stack (for the head,
    zero rows pad the vocabulary)."""
    local = torch.zeros(out_features, *tensors[0].shape[1:], dtype=tensors[0].dtype)
    loader = cast(Callable[[torch.Tensor, torch.Tensor, "str | int | None"], None], owner.weight_loader)
    for tensor, shard_id in zip(tensors, shard_ids):
        loader(local, tensor, shard_id)
    return local


def _input_slice(weight: GroupedWeight, owner: RowParallelLinear) -> tuple[GroupedWeight, int]:
    """A row-parallel layer's input columns [rank * in, (rank + 1) * in): whole groups of levels, and
    their scales and minimums."""
    in_features, rank, group = owner.in_features, owner.tp_rank, weight.group_size
    start = rank * in_features
    if in_features % group:
        raise ValueError(
            f"--quantization gguf: a tensor-parallel rank's {in_features} input columns are no whole groups "
            f"of {group}; use a tensor_parallel_size that leaves each rank a multiple of {group}."
        )
    groups = slice(start // group, (start + in_features) // group)
    minimums = None if weight.minimums is None else weight.minimums[:, groups]
    levels = weight.levels[:, start : start + in_features]
    return GroupedWeight(levels.contiguous(), weight.scales[:, groups].contiguous(), minimums, weight.bits), in_features


def _replace(model: nn.Module, path: str, module: nn.Module, old: nn.Module) -> None:
    keep_layout_attributes(old, module)  # q_size, offsets, ... that the model's forward reads
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)
