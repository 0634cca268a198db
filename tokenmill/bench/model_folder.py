"""One HF folder that every engine of a comparison reads, so all run the same weights.

`--model` may be empty (the embedded SmolLM2-135M), an HF folder, or a preset name: a preset becomes a folder
of random bf16 weights of that architecture (written once with transformers, seeded, into the cache) with the
embedded model's tokenizer copied beside it. Throughput does not depend on the weight values when every
request runs to a fixed length, and prompt ids stay below 10,000, inside any vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenmill.loader.default_model import cache_dir, default_model_path
from tokenmill.loader.presets import PRESETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def resolve_model_folder(model: str | None, seed: int = 0) -> Path:
    """The HF folder for `model` (None, a folder, or a preset name); raises ValueError saying what to give."""
    if model is None:
        return default_model_path()
    if model in PRESETS:
        return preset_folder(model, seed)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model!r} is not an HF folder with a config.json; give one, or a preset "
            f"({', '.join(sorted(PRESETS))}). Peers cannot read a .gguf file: give the HF folder it came from."
        )
    return path


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def preset_folder(name: str, seed: int = 0) -> Path:
    """`$TOKENMILL_CACHE/models/random-<preset>-seed<seed>`: random weights of the preset's shape, made once."""
    target = cache_dir() / "models" / f"random-{name}-seed{seed}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.presets import preset_config

    print(f"writing random {name} weights (seed {seed}) to {target} (once)")
    torch.manual_seed(seed)
    config = preset_config(name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer_source = default_model_path()
    for name_ in TOKENIZER_FILES:
        if (tokenizer_source / name_).is_file():
            shutil.copy(tokenizer_source / name_, tmp / name_)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
