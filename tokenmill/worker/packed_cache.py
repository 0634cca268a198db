"""Packed weights cached on disk: a warm start skips reading, rounding, quantizing and packing the
checkpoint (or drawing a dummy model's random weights).

After a CPU model is loaded and packed (worker/model_loader.py), its tensors go to one safetensors
file beside the model (<folder>/.tokenmill-packed/), or under $TOKENMILL_CACHE/packed/ where the
folder is read-only and for dummy weights. The file's name is a hash of everything the packed tensors
depend on: the weight files (name, size, mtime, inode), the model's config and load settings, the
instruction set the kernels were built for, and the source of the code that loads and packs. Its
header records each packed module (class and plain attributes), so a hit rebuilds them as shells
around the file's tensors and runs no packing code; the packed layers' tensors are read straight into
one huge-page arena, in the order a decode step reads them (as hugepages.gather lays them out). A file
that cannot be read or does not fit the model is ignored and rewritten; files are written under a
temporary name and renamed, so no reader sees a partial one. Each folder keeps its MAX_FILES most
recently used files."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.loader.default_model import cache_dir
from tokenmill.loader.hf import safetensors_files
from tokenmill.ops import moe, packed_gemm
from tokenmill.quant import Bf16Linear, Fp32Linear, GroupedLinear, Int4Linear, Int8Linear, PackedExperts
from tokenmill.worker import packed_file

logger = logging.getLogger(__name__)

FOLDER = ".tokenmill-packed"  # inside the model's folder
MAX_FILES = 4  # per folder: a model served in a few precisions; older files are deleted
# Sources whose change can change the packed tensors (weight loaders, rounding, quantizers, layouts).
_CODE = ("quant", "models", "worker/model_loader.py", "worker/packed_cache.py", "loader/hf.py", "loader/dummy.py")
_SHELLS: dict[str, type[nn.Module]] = {
    cls.__name__: cls for cls in (Bf16Linear, Fp32Linear, Int8Linear, GroupedLinear, Int4Linear, PackedExperts)
}


@dataclass(frozen=True)
class CachedWeights:
    tensors: dict[str, torch.Tensor]  # the state dict, read into huge-page memory
    modules: dict[str, dict[str, Any]]  # path -> {"class", "attrs", "buffers"} of each packed module


def cache_file(config: ModelConfig, folder: Path | None) -> Path:
    """Where the packed weights of this model, loaded this way on this machine, are kept."""
    dummy = config.load_format == "dummy" or folder is None
    key: dict[str, Any] = {
        "code": _code_hash(),
        "isa": packed_gemm.isa(),
        "moe": moe.available(),
        "hf_config": config.hf_config.to_dict(),
        "load": [config.dtype, config.weight_dtype, config.quantization, config.quantization_group_size],
        "zero_point": config.quantization_zero_point,
        "weights": {"dummy_seed": config.seed} if dummy else _file_stats(folder),
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    local = None if dummy or folder is None else folder / FOLDER
    writable = local is not None and os.access(local if local.is_dir() else local.parent, os.W_OK)
    return (local if local is not None and writable else cache_dir() / "packed") / f"{name}.safetensors"


def read(path: Path) -> CachedWeights | None:
    """The file's tensors (in huge-page memory) and modules, or None when it is missing or damaged
    (logged: it is rewritten)."""
    if not path.is_file():
        return None
    try:
        tensors, metadata = packed_file.read(path)
        modules = json.loads(metadata["modules"], object_hook=_tuples)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:  # truncated, bad header, ...
        logger.warning("ignoring the packed-weight cache %s (%s): it is rewritten", path, e)
        return None
    os.utime(path)  # recently used: kept by the next write's clean-up
    return CachedWeights(tensors, modules)


def restore(model: nn.Module, cached: CachedWeights) -> bool:
    """Put the cached packed modules into the meta-built `model` and assign every tensor from the file;
    False (the model then half-filled: build it again) when the file does not fit the model."""
    try:
        for path, spec in cached.modules.items():
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, child, _shell(path, spec, cached.tensors))
        model.load_state_dict(cached.tensors, strict=True, assign=True)
    except (KeyError, AttributeError, RuntimeError, TypeError) as e:
        logger.warning("the packed-weight cache does not fit this model (%s): it is rewritten", e)
        return False
    return True


def write(path: Path, model: nn.Module, arena: list[str]) -> None:
    """Store `model`'s state and packed modules at `path` (a model with nothing packed is not stored);
    `arena`: the names of the tensors a hit reads into one huge-page arena, in its order."""
    modules = {p: _module_spec(m) for p, m in model.named_modules() if type(m).__name__ in _SHELLS}
    if not modules or any(spec is None for spec in modules.values()):
        logger.debug("not caching the packed weights: a packed module holds more than plain attributes")
        return
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    metadata = {"modules": json.dumps(_tagged(modules)), packed_file.ARENA: json.dumps(arena)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        nbytes = sum(t.nbytes for t in tensors.values())
        if shutil.disk_usage(path.parent).free < 2 * nbytes:  # leave the disk at least as much again
            logger.info("not caching %.1f GB of packed weights in %s: too little free disk", nbytes / 1e9, path.parent)
            return
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError) as e:  # a full disk or shared tensors: load cold next time
        logger.warning("could not write the packed-weight cache %s (%s)", path, e)
        tmp.unlink(missing_ok=True)
        return
    _keep_newest(path.parent)


def _shell(path: str, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A packed module rebuilt without its constructor: its attributes and its buffers from the file."""
    cls = _SHELLS[spec["class"]]
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.__dict__.update(spec["attrs"])
    for name in spec["buffers"]:
        module.register_buffer(name, tensors.get(f"{path}.{name}"))  # absent: a None buffer
    return module


def _module_spec(module: nn.Module) -> dict[str, Any] | None:
    """The class, plain attributes and buffer names of a packed module; None when an attribute is not
    plain data (it could not be restored from JSON)."""
    attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    if any(not _plain(v) for v in attrs.values()) or module._parameters or module._modules:
        return None
    return {"class": type(module).__name__, "attrs": attrs, "buffers": list(module._buffers)}


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _tagged(value: Any) -> Any:
    """`value` with its tuples tagged, so that JSON gives them back as tuples (see _tuples)."""
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_tagged(v) for v in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    return value


def _tuples(obj: dict[str, Any]) -> Any:
    return tuple(obj["__tuple__"]) if obj.keys() == {"__tuple__"} else obj


def _file_stats(folder: Path | None) -> list[tuple[str, int, int, int]]:
    files = safetensors_files(folder) if folder is not None else []
    return [(f.name, (s := f.stat()).st_size, s.st_mtime_ns, s.st_ino) for f in files]


@functools.cache
def _code_hash() -> str:
    root = Path(__file__).parent.parent  # the tokenmill package
    digest = hashlib.sha256()
    for entry in _CODE:
        for file in sorted((root / entry).rglob("*.py")) if (root / entry).is_dir() else [root / entry]:
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _keep_newest(folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_mtime, reverse=True)
    for old in files[MAX_FILES:]:
        old.unlink(missing_ok=True)
