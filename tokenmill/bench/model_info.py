"""`tokenmill info MODEL`: whether a model folder or .gguf file is one tokenmill runs, and its shape
(family, layers, parameters, experts), from config.json or the GGUF metadata and the tensor headers
alone: no weight is read, so a 100 GB checkpoint answers at once."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokenmill.loader.gguf_arch import field, is_weight, read_arch, read_config
from tokenmill.models.architectures import architecture_of, unsupported_message


@dataclass(frozen=True)
class ModelInfo:
    path: str
    supported: bool
    message: str  # why not, when unsupported
    architecture: str  # the one tokenmill runs it as, else what the config names
    model_type: str  # the family
    num_layers: int | None
    num_parameters: int | None  # counted from the tensor headers (a tied head once)
    num_experts: int | None  # mixture-of-experts only
    experts_per_token: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_model(path: str | Path) -> ModelInfo:
    """Read a model folder (config.json, *.safetensors) or a .gguf file; ValueError for anything else."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _describe_gguf(path)
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        return _describe(path, config, _safetensors_parameters(path))
    raise ValueError(f"{path} is neither a model folder with a config.json nor a .gguf file")


def _describe(path: Path, config: dict[str, Any], num_parameters: int | None) -> ModelInfo:
    hf_config = SimpleNamespace(**config)
    arch = architecture_of(hf_config)
    named = config.get("architectures") or [config.get("model_type")]
    return ModelInfo(
        path=str(path),
        supported=arch is not None,
        message="" if arch is not None else unsupported_message(hf_config),
        architecture=arch or ", ".join(str(n) for n in named),
        model_type=str(config.get("model_type", "")),
        num_layers=config.get("num_hidden_layers"),
        num_parameters=num_parameters,
        num_experts=config.get("num_experts") or config.get("num_local_experts"),
        experts_per_token=config.get("num_experts_per_tok") if "num_experts_per_tok" in config else None,
    )


def _describe_gguf(path: Path) -> ModelInfo:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    num_parameters = sum(int(t.n_elements) for t in reader.tensors if is_weight(t.name))
    try:
        arch = read_arch(reader)
    except ValueError as exc:
        named = str(field(reader, "general.architecture"))
        return ModelInfo(str(path), False, str(exc), named, named, None, num_parameters, None, None)
    return _describe(path, read_config(reader, arch), num_parameters)


def _safetensors_parameters(folder: Path) -> int | None:
    """Elements of every tensor in the folder's safetensors files, from their JSON headers; None
    when the folder has none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))  # the header's size, then the header
            header = json.loads(f.read(length))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


def format_model_info(info: ModelInfo) -> str:
    rows = [("model", info.path), ("architecture", info.architecture), ("family", info.model_type)]
    rows.append(("supported", "yes" if info.supported else "no"))
    if info.num_layers is not None:
        rows.append(("layers", str(info.num_layers)))
    if info.num_parameters is not None:
        rows.append(("parameters", f"{info.num_parameters:,} ({info.num_parameters / 1e9:.2f} B)"))
    if info.num_experts:
        rows.append(("experts", f"{info.num_experts}, {info.experts_per_token} per token"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
