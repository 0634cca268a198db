"""Read what a checkpoint is (architecture, parameter count, dtype, quantization, context length) from its
config.json and the weight files' headers, without loading a tensor. A PEFT LoRA adapter's folder
(adapter_config.json) is described too: a version of its own, served on its base model."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from tokenmill.registry.errors import RegistryError
from tokenmill.registry.manifest import ModelInfo

# safetensors dtype codes -> torch dtype names (what config.json's torch_dtype uses)
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# Keys models use for their context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# GGUF tensor types that are plain floats, not a quantization.
_GGUF_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# A header larger than this is not a safetensors file (the format caps it at 100 MB).
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def describe(path: Path) -> ModelInfo:
    """Describe an HF folder (config.json + *.safetensors), a LoRA adapter's folder or a single .gguf file."""
    if path.is_file() and path.suffix == ".gguf":
        return describe_gguf(path)
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return describe_lora_folder(path)
    if path.is_dir():
        return describe_hf_folder(path)
    raise RegistryError(
        f"{path} is neither a model folder (config.json + *.safetensors), a LoRA adapter's folder "
        "(adapter_config.json + adapter_model.safetensors) nor a .gguf file"
    )


def describe_lora_folder(folder: Path) -> ModelInfo:
    """A PEFT LoRA adapter: its rank, its base model's name and its weights' size (checked against a base
    only where it is served)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except ValueError as exc:
        raise RegistryError(f"{folder}/adapter_config.json is not JSON ({exc})") from exc
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise RegistryError(f"{folder}/adapter_config.json does not describe a LoRA adapter")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise RegistryError(f"{folder} has no adapter_model.safetensors: save the adapter with safe_serialization")
    numel_by_dtype: Counter[str] = Counter()
    for dtype, numel in _safetensors_numels(weights):
        numel_by_dtype[dtype] += numel
    top = numel_by_dtype.most_common(1)
    base = config.get("base_model_name_or_path")
    return ModelInfo(
        format="lora",
        architecture=f"LoRA r={config.get('r')}",
        parameters=sum(numel_by_dtype.values()),
        dtype=_SAFETENSORS_DTYPES.get(top[0][0], "unknown") if top else "unknown",
        quantization=None,
        context_length=None,
        base_model=str(base) if base else None,
    )


def describe_hf_folder(folder: Path) -> ModelInfo:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise RegistryError(f"{folder} has no config.json: give a Hugging Face model folder or a .gguf file")
    config = json.loads(config_path.read_text())
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise RegistryError(f"{folder} has no *.safetensors weights: save the model with safe_serialization")
    numel_by_dtype: Counter[str] = Counter()
    for weight_file in weights:
        for dtype, numel in _safetensors_numels(weight_file):
            numel_by_dtype[dtype] += numel
    architectures = config.get("architectures") or [config.get("model_type") or "unknown"]
    dtype = config.get("torch_dtype") or config.get("dtype")  # transformers >= 5 writes "dtype"
    if not isinstance(dtype, str):
        dtype = _SAFETENSORS_DTYPES.get(numel_by_dtype.most_common(1)[0][0], "unknown") if numel_by_dtype else "unknown"
    quant = config.get("quantization_config")
    quantization = str(quant.get("quant_method", "unknown")) if isinstance(quant, dict) else None
    return ModelInfo(
        format="hf",
        architecture=str(architectures[0]),
        parameters=sum(numel_by_dtype.values()),
        dtype=dtype,
        quantization=quantization,
        context_length=_context_length(config),
    )


def _context_length(config: dict[str, Any]) -> int | None:
    # Multimodal configs keep the language model's settings in text_config.
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return int(source[key])
    return None


def _safetensors_numels(path: Path) -> list[tuple[str, int]]:
    """(dtype, number of elements) of each tensor, from the header: 8 bytes of length, then JSON."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise RegistryError(f"{path} is not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_SAFETENSORS_HEADER:
            raise RegistryError(f"{path} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise RegistryError(f"{path} is not a safetensors file ({exc})") from exc
    return [(t["dtype"], math.prod(t["shape"])) for name, t in header.items() if name != "__metadata__"]


def describe_gguf(path: Path) -> ModelInfo:
    from gguf import GGUFReader, LlamaFileType  # imported here: parsing numpy-heavy code only for GGUF

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise RegistryError(f"{path} is not a readable GGUF file ({exc})") from exc
    arch = _gguf_field(reader, "general.architecture")
    architecture = str(arch) if arch is not None else "unknown"
    numel_by_type: Counter[str] = Counter()
    for tensor in reader.tensors:
        numel_by_type[tensor.tensor_type.name] += int(tensor.n_elements)
    file_type = _gguf_field(reader, "general.file_type")
    if file_type is not None and int(file_type) in LlamaFileType._value2member_map_:
        # MOSTLY_Q4_1 -> Q4_1, ALL_F32 -> F32
        dtype = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    else:  # no file type: the type holding most of the weights
        dtype = numel_by_type.most_common(1)[0][0] if numel_by_type else "unknown"
    context = _gguf_field(reader, f"{architecture}.context_length")
    return ModelInfo(
        format="gguf",
        architecture=architecture,
        parameters=sum(numel_by_type.values()),
        dtype=dtype,
        quantization=None if dtype in _GGUF_FLOAT_TYPES else dtype,
        context_length=int(context) if context is not None else None,
    )


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()
