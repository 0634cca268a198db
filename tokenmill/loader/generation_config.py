"""A model's recommended sampling, read from its generation_config.json (vLLM's `--generation-config`).

Usage::

    defaults = load_sampling_defaults("auto", Path("models/SmolLM2-135M-Instruct"))
    # {"temperature": 0.2, "top_p": 0.9}: what a request gets for the fields it leaves out

`generation_config` is "auto" (the model folder's file; none there: no defaults), "vllm" (ignore the
model's file: OpenAI's defaults) or a folder that must hold a generation_config.json.

Like vLLM, only the sampling keys below are taken, and `do_sample` is not one of them: HF's
`generate()` decodes greedily when `do_sample` is false whatever the temperature says, but vLLM reads a
file's temperature, top_p, ... as the defaults even then (a file that wants greedy says temperature 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tokenmill.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder path
# HF generation_config.json key -> SamplingParams field (the keys vLLM's get_diff_sampling_param maps).
_FLOAT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
_INT_KEYS = {"top_k": "top_k", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(generation_config: str, model_folder: Path | None) -> dict[str, float | int]:
    """The sampling defaults `generation_config` selects, as SamplingParams field names. ValueError
    for a folder without the file, a file that is not JSON, or a value SamplingParams would reject."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = None if model_folder is None else model_folder / GENERATION_CONFIG_FILE
        if path is None or not path.is_file():
            return {}
    else:
        folder = Path(generation_config).expanduser()
        path = folder / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(
                f"--generation-config {generation_config!r}: no {GENERATION_CONFIG_FILE} in that "
                f"folder; give a folder holding one, 'auto' (the model's) or 'vllm' (none)."
            )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}; fix the file or pass --generation-config vllm.") from exc
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} holds {type(config).__name__}, not a JSON object; fix the file or pass --generation-config vllm."
        )
    return parse_sampling_defaults(config, str(path))


def parse_sampling_defaults(config: dict[str, Any], source: str = GENERATION_CONFIG_FILE) -> dict[str, float | int]:
    """The sampling keys of a generation_config.json's contents, renamed to SamplingParams fields;
    absent or null keys are left out."""
    defaults: dict[str, float | int] = {}
    for key, name in (_FLOAT_KEYS | _INT_KEYS).items():
        value = config.get(key)
        if value is None:
            continue
        integral = isinstance(value, int) or isinstance(value, float) and value.is_integer()
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (key in _INT_KEYS and not integral)
        ):
            kind = "an integer" if key in _INT_KEYS else "a number"
            raise ValueError(
                f"{source}: {key} must be {kind}, got {value!r}; fix the file or pass --generation-config vllm."
            )
        defaults[name] = int(value) if key in _INT_KEYS else float(value)
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{source}: {exc} Fix the file or pass --generation-config vllm.") from exc
    return defaults


def describe_sampling_defaults(generation_config: str, defaults: dict[str, float | int]) -> str:
    """One line for the startup message and the log: which sampling defaults requests get."""
    if generation_config == "vllm":
        return (
            "sampling defaults: OpenAI's (temperature=1.0, top_p=1.0); the model's generation_config.json "
            "is ignored (--generation-config vllm)"
        )
    where = ("the model's " if generation_config == "auto" else f"{generation_config}/") + GENERATION_CONFIG_FILE
    if not defaults:
        return f"sampling defaults: OpenAI's (temperature=1.0, top_p=1.0); {where} sets none"
    values = ", ".join(f"{name}={value}" for name, value in defaults.items())
    ignore = "; --generation-config vllm to ignore" if generation_config == "auto" else ""
    return f"sampling defaults from {where}: {values} (requests may override{ignore})"
