"""Local Hugging Face folders: config, (sharded) safetensors, tokenizer, generation config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}.")
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor, read lazily from mmapped files."""
    for file in safetensors_files(Path(folder)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def eos_token_ids(folder: str | Path, hf_config: Any) -> list[int]:
    """Every id that ends generation: generation_config.json's list, else config.json's."""
    ids: list[int] = []
    gen_file = Path(folder) / "generation_config.json"
    sources = [json.loads(gen_file.read_text()).get("eos_token_id")] if gen_file.is_file() else []
    sources.append(getattr(hf_config, "eos_token_id", None))
    for value in sources:
        for tok in value if isinstance(value, list) else [value]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    return ids


def has_tokenizer(folder: str | Path) -> bool:
    folder = Path(folder)
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(folder: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
