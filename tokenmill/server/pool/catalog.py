"""What the server can serve beside its default model: the registry's versions and aliases, and the
`--extra-model` folders, each as a ModelEntry the pool can load."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from tokenmill.registry import Registry, RegistryBusyError, RegistryError, UnknownModelError, Version
from tokenmill.registry.describe import describe
from tokenmill.server.errors import APIError

# An admin request waits at most this long for another registry writer (`tokenmill models add`, say).
REGISTRY_LOCK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelEntry:
    """One loadable model: a registry version (`name@version`) or an extra model (its name)."""

    id: str  # the model_name label, the responses' `model`, the pool's key
    name: str
    version: str | None  # None for extra models, which have no versions
    path: Path  # the HF folder or .gguf to load
    parameters: int
    dtype: str  # the checkpoint's (bfloat16, float32, or a GGUF file type)
    file_bytes: int
    version_ref: Version | None = None  # the registry's record, to verify against its manifest


def _from_version(version: Version) -> ModelEntry:
    m = version.manifest
    if m.format == "lora":  # served on a base model, not loaded as one
        raise UnknownModelError(
            f"{m.id} is a LoRA adapter (of {m.base_model or 'an unnamed base'}), not a model: serve it on its "
            f"base with --enable-lora --lora-modules NAME={m.id}"
        )
    return ModelEntry(m.id, m.name, m.version, version.model_path, m.parameters, m.dtype, m.size, version)


class Catalog:
    """Resolves a request's `model` to a ModelEntry. Extra models are looked up first, then the registry
    (`name@version`, an alias, or a bare name: its alias of the same name, else its highest version).
    Registry reads take no lock and see an alias move at once: the next request resolves to the new target."""

    def __init__(self, registry: Registry | None = None, extra_models: tuple[tuple[str, str], ...] = ()) -> None:
        self.registry = registry
        self._extra: dict[str, ModelEntry] = {}
        for name, path in extra_models:
            folder = Path(path).expanduser()
            if not folder.exists():
                raise ValueError(f"--extra-model {name}={path}: {folder} does not exist")
            info = describe(folder)
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0
            size = size or folder.stat().st_size
            self._extra[name] = ModelEntry(name, name, None, folder, info.parameters, info.dtype, size)

    def resolve(self, model_id: str) -> ModelEntry:
        """The entry `model_id` names; UnknownModelError (a KeyError and ValueError) if none."""
        if model_id in self._extra:
            return self._extra[model_id]
        if self.registry is None:
            known = ", ".join(sorted(self._extra))
            raise UnknownModelError(f"no model {model_id!r}; the extra models are: {known}")
        return _from_version(self.registry.resolve(model_id))

    def aliases(self) -> dict[str, str]:
        """alias -> `name@version` (the registry's; extra models have none)."""
        return self.registry.aliases() if self.registry is not None else {}

    def served_ids(self) -> list[tuple[str, ModelEntry]]:
        """Every id a client may send, with the entry it resolves to now: each `name@version`, each bare
        name, each alias, and each extra model."""
        found: dict[str, ModelEntry] = dict(self._extra)
        if self.registry is not None:
            versions = [v for v in self.registry.list() if v.manifest.format != "lora"]
            for version in versions:
                found.setdefault(version.id, _from_version(version))
            for model_id in [v.name for v in versions] + sorted(self.aliases()):
                if model_id not in found:
                    try:
                        found[model_id] = self.resolve(model_id)
                    except UnknownModelError:
                        pass  # a dangling alias, or an adapter's: nothing to serve under it
        return list(found.items())

    def verify(self, entry: ModelEntry) -> None:
        """Re-hash a registry version against its manifest before loading it (RegistryCorruptError)."""
        if self.registry is not None and entry.version_ref is not None:
            self.registry.verify(entry.version_ref)

    def set_alias(self, alias: str, model_id: str) -> tuple[ModelEntry, str | None]:
        """Point `alias` at what `model_id` resolves to; returns the new target and the id it pointed at."""
        if self.registry is None:
            raise RegistryError("aliases live in a registry: start the server with --registry DIR")
        previous = self.aliases().get(alias)
        return _from_version(self.registry.set_alias(alias, model_id)), previous

    async def move_alias(self, alias: str, model_id: str) -> tuple[ModelEntry, str | None]:
        """set_alias on a worker thread: the registry's lock and fsync never block the event loop. A 503
        (Retry-After) when another writer holds the registry past its lock timeout."""
        try:
            return await asyncio.to_thread(self.set_alias, alias, model_id)
        except RegistryBusyError:
            raise APIError(
                503,
                "the model registry is busy with another write (a model being added, say); retry shortly.",
                "registry_busy",
                headers={"Retry-After": "5"},
            ) from None
