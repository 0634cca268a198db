"""From a user's `model` argument to the model's files and config, and the precision it runs in."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.loader import hf
from tokenmill.loader.default_model import cache_dir, default_model_path, find_default_gguf
from tokenmill.loader.hf_config import HFConfig, config_for_model, load_hf_config
from tokenmill.loader.presets import PRESETS
from tokenmill.ops.build import cpu_has_avx512_bf16

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    folder: Path | None  # None for a dummy preset
    hf_config: HFConfig
    tokenizer: str | None
    eos_token_ids: list[int]
    # quantization="gguf": the .gguf file the weights are served from as they are quantized (the
    # folder then holds its config and tokenizer only, or, for the default model, its bf16 expansion).
    gguf_file: Path | None = None


def _gguf_folder(path: Path, weights: bool = True) -> Path:
    """The HF folder converted from `path` (cached by path, size and time): with bf16 weights, or only
    config and tokenizer (`weights` False) for a model served from the GGUF itself."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "gguf" / f"{path.stem}-{key}{'' if weights else '-config'}"
    if not (folder / "config.json").is_file():
        from tokenmill.loader.gguf import gguf_to_hf_folder  # gguf and transformers: only to convert

        gguf_to_hf_folder(path, folder, weights=weights)
    return folder


def _is_gguf(path: Path, load_format: str) -> bool:
    return path.is_file() and path.suffix == ".gguf" or load_format == "gguf"


def resolve_source(model: str | None, load_format: str, quantization: str | None = None) -> ModelSource:
    """Find the model: the embedded default, a .gguf file, an HF folder, or a dummy preset."""
    if quantization == "gguf":
        return _native_gguf_source(model, load_format)
    if model is None:
        model = str(default_model_path())
    if load_format == "dummy" and model in PRESETS:
        cfg = config_for_model(PRESETS[model])
        return ModelSource(None, cfg, None, hf.eos_token_ids("/nonexistent", cfg))
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: give a local HF folder, a .gguf file, or with "
            f"load_format='dummy' one of the presets {sorted(PRESETS)}."
        )
    if _is_gguf(path, load_format):
        path = _gguf_folder(path)
    return _folder_source(path)


def _native_gguf_source(model: str | None, load_format: str) -> ModelSource:
    """quantization="gguf": the .gguf file itself, with a folder for its config and tokenizer."""
    if model is None:  # the default model's folder is its bf16 expansion, converted once and shared
        return dataclasses.replace(_folder_source(default_model_path()), gguf_file=find_default_gguf())
    path = Path(model).expanduser()
    if not (path.is_file() and _is_gguf(path, load_format)):
        raise ValueError(
            f"quantization='gguf' serves a .gguf file's own quantized weights, and {model!r} is not a .gguf "
            "file; give a .gguf model, or use --quantization int8 / int4 for an HF checkpoint."
        )
    return dataclasses.replace(_folder_source(_gguf_folder(path, weights=False)), gguf_file=path)


def _folder_source(path: Path) -> ModelSource:
    cfg = load_hf_config(path)
    tokenizer = str(path) if hf.has_tokenizer(path) else None
    return ModelSource(path, cfg, tokenizer, hf.eos_token_ids(path, cfg))


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None = None) -> str:
    """ "auto": bf16 on CUDA and on CPUs with bf16 arithmetic (AVX-512 BF16 / AMX). Elsewhere bf16
    weights widened to float32 in the GEMM's registers when the checkpoint is 16-bit (`checkpoint_dtype`
    bfloat16 or float16; a GGUF file's expansion is bf16): as accurate as the checkpoint, half the bytes
    of float32 to move, and decode is bandwidth bound. An fp32 checkpoint (or an unknown one) stays
    float32 there."""
    if dtype in ("bfloat16", "float32", "float16"):
        return dtype
    if dtype in ("bf16", "fp32", "fp16", "half", "float"):
        return {"bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(dtype, "float16")
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32.")
    if device.startswith("cuda") or cpu_has_bf16():
        return "bfloat16"
    if device == "cpu" and checkpoint_dtype in ("bfloat16", "float16"):
        return "bfloat16"
    return "float32"


def resolve_precision(dtype: str, device: str, checkpoint_dtype: str | None = None) -> tuple[str, str | None]:
    """(arithmetic dtype, weight rounding dtype or None). bf16 on a CPU means bf16 weights packed for
    our C++ GEMM (quant/bf16.py) with float32 activations between the GEMMs (norms, residual stream,
    attention): on CPUs with AVX-512 BF16 the GEMMs multiply bf16-rounded activations with bf16
    dot-product instructions (float32 sums), elsewhere they widen the weights to float32 (torch's own
    bf16 GEMMs run several times slower there; llama.cpp's CPU path does the same)."""
    resolved = resolve_dtype(dtype, device, checkpoint_dtype)
    if resolved == "bfloat16" and device == "cpu":
        return "float32", "bfloat16"
    return resolved, None


def cpu_has_bf16() -> bool:
    """True where the CPU computes bf16 natively (AVX-512 BF16 or AMX) and our kernels are built for it
    (not under TOKENMILL_CPU_ISA=avx2); elsewhere fp32 is faster. See tokenmill/ops/build.py."""
    return cpu_has_avx512_bf16()


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype the checkpoint's config says its weights are stored in ("bfloat16", ...), or None."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(value).removeprefix("torch.") if value is not None else None
