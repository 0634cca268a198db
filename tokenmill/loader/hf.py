"""Local Hugging Face folders: config, (sharded) safetensors, tokenizer, generation config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

if TYPE_CHECKING:  # torch only in hints: config resolution (serve, before the engine spawn) needs none
    import torch


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

    config = _tokenizer_model_config(Path(folder))
    return AutoTokenizer.from_pretrained(str(folder), **({"config": config} if config is not None else {}))


def _tokenizer_model_config(folder: Path) -> Any | None:
    """The model config AutoTokenizer reads, as transformers' generic class, where the tokenizer names its own
    class: AutoTokenizer then reads only the config's plain fields (model_type, ...), and the family's config
    class costs a second to import (see hf_config.py). None (AutoTokenizer loads it) where it picks the class
    by the config's type or may run the model's own code."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if not (folder / "tokenizer_config.json").is_file() or not (folder / "config.json").is_file():
        return None
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    declared = tokenizer_config.get("tokenizer_class")
    if not isinstance(declared, str) or "auto_map" in tokenizer_config:
        return None
    name = declared.removesuffix("Fast")  # AutoTokenizer looks the class up by both names
    if tokenizer_class_from_name(name) is None and tokenizer_class_from_name(f"{name}Fast") is None:
        return None
    values = json.loads((folder / "config.json").read_text())
    if "auto_map" in values:
        return None
    # name_or_path as AutoConfig sets it: AutoTokenizer matches it against hub ids.
    return PreTrainedConfig.from_dict(values, name_or_path=str(folder))
