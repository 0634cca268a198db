"""Build the model on the meta device, fill it with its weights, then swap in the packed or quantized
linear layers (and mixture-of-experts experts) the CPU kernels run."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import pp_world_size, tp_world_size
from tokenmill.loader import hf
from tokenmill.loader.dummy import init_dummy_weights
from tokenmill.models.architectures import model_class
from tokenmill.models.layers.moe import FusedExperts
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.ops import hugepages, packed_gemm
from tokenmill.ops import moe as moe_ops
from tokenmill.quant import (
    GroupedLinear,
    Int8Linear,
    PackedExperts,
    PackedFloatLinear,
    QuantOptions,
    pack_bf16_weights,
    pack_fp32_weights,
    quantize_model,
)
from tokenmill.worker import packed_cache
from tokenmill.worker.model_interface import LoadsWeights

if TYPE_CHECKING:
    from tokenmill.loader.gguf_weights import GGUFWeights


def load_model(config: ModelConfig, folder: Path | None, backend: AttentionBackend, device: str) -> nn.Module:
    cache = _cache_file(config, folder, device)
    cached = packed_cache.read(cache) if cache is not None else None
    if cached is not None:
        model = _build(config, backend, device)
        if packed_cache.restore(model, cached):  # the packed tensors were read into their arena
            return model.eval()
    model = _build(config, backend, device)
    _fill(model, config, folder, device)
    if device == "cpu":
        pack_experts(model, config)
        place_packed_weights(model)
    if cache is not None:
        packed_cache.write(cache, model, [f"{path}.{name}" for path, _, name in _packed_buffers(model)])
    return model.eval()


def _cache_file(config: ModelConfig, folder: Path | None, device: str) -> Path | None:
    """Where the packed CPU weights are cached (worker/packed_cache.py); None where they are not: on
    other devices, under tensor or pipeline parallelism (each rank packs its shard) and for a .gguf
    file's blocks."""
    if device != "cpu" or tp_world_size() > 1 or pp_world_size() > 1 or config.quantization == "gguf":
        return None
    return packed_cache.cache_file(config, folder)


def _build(config: ModelConfig, backend: AttentionBackend, device: str) -> nn.Module:
    """The model on the meta device, its rotary tables computed on `device`."""
    cls = model_class(config.hf_config)
    with torch.device("meta"):
        model = cls(config.hf_config, backend, config.max_model_len)
    model = model.to(getattr(torch, config.dtype))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers(torch.device(device))
    return model


def _fill(model: nn.Module, config: ModelConfig, folder: Path | None, device: str) -> None:
    """Allocate the meta model's tensors, load (or draw) its weights, then round, quantize or pack the
    linear layers for the kernels that run them."""
    # --quantization gguf: the file's quantized layers are built from its blocks before anything is
    # allocated, so their float expansion never is; the rest loads as float below.
    gguf: GGUFWeights | None = None
    served_natively: set[str] = set()
    if config.quantization == "gguf":  # imported here: the gguf package is slow to import
        from tokenmill.loader.gguf_weights import GGUFWeights
        from tokenmill.worker.gguf_native import attach_gguf_linears

        gguf = GGUFWeights(config.model)
        served_natively = attach_gguf_linears(model, gguf, device)
    materialize(model, device)
    if config.load_format == "dummy" or folder is None:
        init_dummy_weights(model, config.seed)
    else:
        # The registry hands out nn.Module classes; every one of them loads HF checkpoints.
        weights = gguf.float_weights(skip=served_natively) if gguf is not None else hf.iterate_weights(folder)
        loaded = cast(LoadsWeights, model).load_weights(weights)
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"the checkpoint in {folder} lacks {sorted(missing)[:5]} ...")
    if config.weight_dtype is not None:
        round_weights(model, getattr(torch, config.weight_dtype))
    if config.quantization not in (None, "gguf"):  # a module swap on the loaded float weights
        options = QuantOptions(config.quantization_group_size, config.quantization_zero_point)
        quantize_model(model, config.quantization, options)
    elif config.weight_dtype == "bfloat16" and device == "cpu":
        if packed_gemm.available():  # half the bytes per decode step; the same numbers
            pack_bf16_weights(model)
            packed_gemm.amx()  # says once where the CPU has AMX tiles but they run nothing
    elif config.dtype == "float32" and config.weight_dtype is None and device == "cpu":
        if packed_gemm.isa() == "avx2":  # a decode batch at the FMA peak (see Fp32Linear); the same arithmetic
            pack_fp32_weights(model)


def pack_experts(model: nn.Module, config: ModelConfig) -> None:
    """Swap every FusedExperts for PackedExperts, in the precision the linear layers took (int8 / int4
    under those quantizations, else bf16 for bf16 weights, else float32): every expert of a layer in
    one C++ call. Where the op cannot be built the FusedExperts' torch forward stays."""
    targets = [(path, m) for path, m in model.named_modules() if isinstance(m, FusedExperts)]
    if not targets or not moe_ops.available():
        return
    if config.quantization in ("int8", "int4"):
        kind = config.quantization
    elif "bfloat16" in (config.weight_dtype, config.dtype):
        kind = "bfloat16"
    else:
        kind = "float32"
    for path, experts in targets:
        parent_path, _, child = path.rpartition(".")
        packed = PackedExperts.from_weights(
            experts.w13,
            experts.w2,
            kind,
            group_size=config.quantization_group_size,
            zero_point=config.quantization_zero_point,
            row_parallel=tp_world_size() > 1,
        )
        setattr(model.get_submodule(parent_path) if parent_path else model, child, packed)


def materialize(model: nn.Module, device: str) -> None:
    """Allocate (uninitialised) the tensors still on the meta device; modules already built from a
    checkpoint (attach_gguf_linears) keep theirs."""
    for module in model.modules():
        own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)


def place_packed_weights(model: nn.Module) -> None:
    """Move the packed linear layers' tensors into one huge-page buffer (see tokenmill/ops/hugepages.py),
    in module order: the order a decode step reads them."""
    owners = _packed_buffers(model)
    if not owners:
        return
    copies = hugepages.gather([getattr(module, name) for _, module, name in owners])
    for (_, module, name), copy in zip(owners, copies):
        setattr(module, name, copy)


def _packed_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(module path, module, buffer name) of the packed layers' CPU tensors, in module order."""
    return [
        (path, module, name)
        for path, module in model.named_modules()
        if isinstance(module, (PackedFloatLinear, Int8Linear, GroupedLinear, PackedExperts))
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.device.type == "cpu"
    ]


@torch.no_grad()
def round_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every parameter to `dtype` in place, keeping its storage dtype."""
    for param in model.parameters():
        param.copy_(param.to(dtype))
