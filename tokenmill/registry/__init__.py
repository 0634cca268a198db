"""A model registry on disk: immutable, verified model versions under names, and aliases that point at them.

Usage::

    from tokenmill.registry import Registry

    registry = Registry()  # <tokenmill cache>/registry ($TOKENMILL_CACHE); or Registry("/srv/models")
    registry.add("smol", "/models/smol")  # smol@1: an HF folder or a .gguf, hard-linked or copied
    registry.add("smol", "/models/smol-ft", alias="smol-stable")  # smol@2
    registry.resolve("smol-stable").model_path  # the folder (or .gguf) to load
    registry.verify("smol@1")  # re-hash against the manifest: RegistryCorruptError names a bad file

From the command line: `tokenmill models add | list | show | rm | alias | verify` (tokenmill.registry.cli).
Needs neither the server nor Ray.
"""

from tokenmill.registry.errors import RegistryBusyError, RegistryCorruptError, RegistryError, UnknownModelError
from tokenmill.registry.manifest import FileEntry, Manifest
from tokenmill.registry.store import Registry, Version, default_registry_dir

__all__ = [
    "FileEntry",
    "Manifest",
    "Registry",
    "RegistryBusyError",
    "RegistryCorruptError",
    "RegistryError",
    "UnknownModelError",
    "Version",
    "default_registry_dir",
]
