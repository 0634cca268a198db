"""A model's Hugging Face config as plain attributes, resolved by transformers once and then read from a cache.

Usage::

    from tokenmill.loader.hf_config import load_hf_config
    cfg = load_hf_config("/models/SmolLM2")  # cfg.hidden_size, cfg.rope_parameters, ... as AutoConfig gives them

transformers' config classes fill in each family's defaults and rewrite older layouts (rope_scaling into
rope_parameters, ...), so they stay the one source of those rules; but importing one costs about a second
(transformers 5's config modules pull in torch.distributed.tensor and torch._dynamo). The first load of a
config.json runs AutoConfig and stores the resolved values in ``$TOKENMILL_CACHE/hf_configs/``, keyed by the
file's bytes and the transformers version; later loads, and the engine process that receives the config,
import no transformers at all.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.loader.default_model import cache_dir

logger = logging.getLogger(__name__)

# Properties transformers computes from stored values; to_dict() leaves them out, but callers read them.
_PROPERTIES = ("name_or_path", "num_labels", "rope_scaling")
# Where the config was read from (the folder as given; "" for one built from values), as transformers keeps it.
_PATH_NAMES = ("_name_or_path", "name_or_path")


class HFConfig:
    """The resolved config's values as attributes; a missing one raises AttributeError, as on transformers'
    config, so ``getattr(cfg, name, default)`` behaves the same on both."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name == "dtype" and isinstance(value, str):
            # A cached entry holds the dtype's name; the torch.dtype (as on transformers' config) is made where
            # it is read, so resolving a config (serve, before the engine spawn) imports no torch.
            import torch

            dtype = getattr(torch, value, None)
            return dtype if isinstance(dtype, torch.dtype) else value
        return value

    def __getattr__(self, name: str) -> Any:  # only called for names that are not set
        raise AttributeError(f"the model's config has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dict__}

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


def load_hf_config(path: str | Path) -> HFConfig:
    """The config of the HF folder at ``path``, with every default transformers' class for it fills in."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a model folder: config.json is missing.")

    def resolve() -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(folder))

    return _cached(config_file.read_bytes(), resolve, name_or_path=str(folder))


def config_for_model(values: dict[str, Any]) -> HFConfig:
    """`AutoConfig.for_model(model_type, **rest)` of ``values``, flattened and cached like load_hf_config."""

    def resolve() -> Any:
        from transformers import AutoConfig

        rest = dict(values)
        return AutoConfig.for_model(rest.pop("model_type"), **rest)

    return _cached(repr(sorted(values.items())).encode(), resolve, name_or_path="")


def _cached(source: bytes, resolve: Callable[[], Any], name_or_path: str) -> HFConfig:
    """The entry keyed by `source` and the transformers version, else `resolve()`'s values, stored there. The
    path the config was read from is the one value that depends on more than the file: it is set on load, so
    copies of one config.json (say in temporary folders) share an entry."""
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(version.encode() + b"\0" + source).hexdigest()[:32]
    path = cache_dir() / "hf_configs" / f"{key}.txt"
    values = _read(path)
    if values is None:
        values = _flatten(resolve())
        _store(path, {name: value for name, value in values.items() if name not in _PATH_NAMES})
    return HFConfig(values | dict.fromkeys(_PATH_NAMES, name_or_path))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return _decode(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, SyntaxError) as exc:  # unreadable or damaged: resolved and written again
        logger.warning("ignoring the cached model config %s: %s", path, exc)
        return None


def _flatten(config: Any) -> dict[str, Any]:
    """A transformers config's values, with its attribute_map aliases and computed properties (a nested config
    stays a transformers object, and the entry is then not cached)."""
    # to_dict() names every stored value, but writes some differently (the dtype as its name, the running
    # transformers version), so the values are read as attributes.
    names = [*config.to_dict(), *config.attribute_map, *_PROPERTIES]
    return {name: getattr(config, name) for name in names if hasattr(config, name)}


def _with_dtype_name(values: dict[str, Any]) -> dict[str, Any]:
    # transformers' config holds the checkpoint's dtype as a torch.dtype, and to_dict() writes its name.
    dtype = values.get("dtype")
    return {**values, "dtype": str(dtype).removeprefix("torch.")} if dtype is not None else values


def _encode(values: dict[str, Any]) -> str:
    return repr(_with_dtype_name(values))


def _decode(text: str) -> dict[str, Any]:
    values: dict[str, Any] = ast.literal_eval(text)  # literals only: int keys and tuples survive, no code runs
    return values


def _store(path: Path, values: dict[str, Any]) -> None:
    """Write the cache entry atomically; a value that would not read back the same (a nested config object,
    nan) or a read-only cache leaves it unwritten, and the next start resolves the config again."""
    text = _encode(values)
    try:
        if _decode(text) != _with_dtype_name(values):
            logger.debug("not caching a config whose values do not round-trip: %s", path.name)
            return
    except (ValueError, SyntaxError):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("cannot cache the resolved model config in %s: %s", path.parent, exc)
