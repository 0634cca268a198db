"""A version's manifest: what the model is and which files (with their sha256) make it up."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MANIFEST_FILE = "manifest.json"

ModelFormat = Literal["hf", "gguf", "lora"]  # "lora": a PEFT LoRA adapter's folder


@dataclass(frozen=True)
class FileEntry:
    """One stored file: its path relative to the version's `files/` folder, its size in bytes and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelInfo:
    """What a checkpoint says about itself, read from config.json and weight headers (never the tensors)."""

    format: ModelFormat
    architecture: str
    parameters: int
    dtype: str  # torch dtype name for HF folders ("bfloat16"); the GGUF file type ("Q4_1")
    quantization: str | None  # quantization_config's quant_method, or a quantized GGUF's type
    context_length: int | None
    base_model: str | None = None  # a LoRA adapter's base (its adapter_config's base_model_name_or_path)


@dataclass(frozen=True)
class Manifest:
    """The immutable record of one version, stored as `manifest.json` beside its `files/` folder."""

    name: str
    version: str
    format: ModelFormat
    architecture: str
    parameters: int
    dtype: str
    quantization: str | None
    context_length: int | None
    files: tuple[FileEntry, ...]
    created: str  # ISO 8601, UTC
    source: str  # the path it was added from
    base_model: str | None = None  # a LoRA adapter's base model (None: not an adapter, or not named)

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        fields = dict(data)
        fields["files"] = tuple(FileEntry(**f) for f in data["files"])
        return cls(**fields)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        return cls.from_dict(json.loads((folder / MANIFEST_FILE).read_text()))

    def write(self, folder: Path) -> None:
        (folder / MANIFEST_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
