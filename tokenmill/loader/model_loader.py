"""From a user's `model` argument to a materialised nn.Module with its weights."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill import hugepages
from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.loader import hf
from tokenmill.loader.dummy import init_dummy_weights
from tokenmill.loader.presets import PRESETS, preset_config
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.registry import model_class

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    folder: Path | None  # None for a dummy preset
    hf_config: Any
    tokenizer: str | None
    eos_token_ids: list[int]


def cache_dir() -> Path:
    import os

    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def _gguf_folder(path: Path) -> Path:
    from tokenmill.loader.gguf import gguf_to_hf_folder

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if not (folder / "config.json").is_file():
        gguf_to_hf_folder(path, folder)
    return folder


def resolve_source(model: str | None, load_format: str) -> ModelSource:
    """Find the model: the embedded default, a .gguf file, an HF folder, or a dummy preset."""
    if model is None:
        from tokenmill.loader.default_model import default_model_path

        model = str(default_model_path())
    if load_format == "dummy" and model in PRESETS:
        cfg = preset_config(model)
        return ModelSource(None, cfg, None, hf.eos_token_ids("/nonexistent", cfg))
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: give a local HF folder, a .gguf file, or with "
            f"load_format='dummy' one of the presets {sorted(PRESETS)}."
        )
    if path.is_file() and path.suffix == ".gguf" or load_format == "gguf":
        path = _gguf_folder(path)
    cfg = hf.load_hf_config(path)
    tokenizer = str(path) if hf.has_tokenizer(path) else None
    return ModelSource(path, cfg, tokenizer, hf.eos_token_ids(path, cfg))


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype in ("bfloat16", "float32", "float16"):
        return dtype
    if dtype in ("bf16", "fp32", "fp16", "half", "float"):
        return {"bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(dtype, "float16")
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32.")
    if device.startswith("cuda") or cpu_has_bf16():
        return "bfloat16"
    return "float32"


def resolve_precision(dtype: str, device: str) -> tuple[str, str | None]:
    """(arithmetic dtype, weight rounding dtype or None). bf16 on a CPU means bf16 weights packed for
    our C++ GEMM (quant/bf16.py) with float32 activations between the GEMMs (norms, residual stream,
    attention): on CPUs with AVX-512 BF16 the GEMMs multiply bf16-rounded activations with bf16
    dot-product instructions (float32 sums), elsewhere they widen the weights to float32 (torch's own
    bf16 GEMMs run several times slower there; llama.cpp's CPU path does the same)."""
    resolved = resolve_dtype(dtype, device)
    if resolved == "bfloat16" and device == "cpu":
        return "float32", "bfloat16"
    return resolved, None


def cpu_has_bf16() -> bool:
    """True where the CPU computes bf16 natively (AVX-512 BF16 or AMX); elsewhere fp32 is faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_model(config: ModelConfig, folder: Path | None, backend: AttentionBackend, device: str) -> nn.Module:
    dtype = getattr(torch, config.dtype)
    cls = model_class(config.hf_config)
    with torch.device("meta"):
        model = cls(config.hf_config, backend, config.max_model_len)
    model = model.to(dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers(torch.device(device))
    if config.load_format == "dummy" or folder is None:
        init_dummy_weights(model, config.seed)
    else:
        loaded = model.load_weights(hf.iterate_weights(folder))
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"the checkpoint in {folder} lacks {sorted(missing)[:5]} ...")
    if config.weight_dtype is not None:
        round_weights(model, getattr(torch, config.weight_dtype))
    if config.quantization is not None:  # a module swap on the loaded float weights
        from tokenmill.quant import quantize_model

        quantize_model(model, config.quantization)
    elif config.weight_dtype == "bfloat16" and device == "cpu":
        from tokenmill.quant import kernels, pack_bf16_weights

        if kernels.available():  # half the bytes per decode step; the same numbers
            pack_bf16_weights(model)
    if device == "cpu":
        place_packed_weights(model)
    return model.eval()


def place_packed_weights(model: nn.Module) -> None:
    """Move the packed linear layers' tensors into one huge-page buffer (see tokenmill/hugepages.py),
    in module order: the order a decode step reads them."""
    from tokenmill.quant import Bf16Linear, Int8Linear

    owners = [
        (module, name)
        for module in model.modules()
        if isinstance(module, (Bf16Linear, Int8Linear))
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.device.type == "cpu"
    ]
    if not owners:
        return
    copies = hugepages.gather([getattr(module, name) for module, name in owners])
    for (module, name), copy in zip(owners, copies):
        setattr(module, name, copy)


@torch.no_grad()
def round_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every parameter to `dtype` in place, keeping its storage dtype."""
    for param in model.parameters():
        param.copy_(param.to(dtype))
