"""The registry on disk: immutable model versions, aliases that point at them, and how ids resolve.

Layout of the registry folder::

    models/<name>/<version>/manifest.json   what the version is, each file's size and sha256
    models/<name>/<version>/files/          the HF folder's files, or the single .gguf
    aliases.json                            {"smol-stable": "smol@2"}
    .lock                                   flock'ed by every write: one writer at a time
    .tmp/                                   versions being built (each flock'ed by its builder) or deleted

Reads take no lock: a version appears and disappears by one rename, aliases.json by one os.replace.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tokenmill.registry.describe import describe
from tokenmill.registry.errors import RegistryCorruptError, RegistryError, UnknownModelError
from tokenmill.registry.files import (
    HashCache,
    exclusive_lock,
    link_or_copy,
    sha256_of,
    try_flock,
    write_json_atomic,
)
from tokenmill.registry.manifest import MANIFEST_FILE, FileEntry, Manifest

# Names, versions and aliases: a path component that cannot be "..", hidden, or hold the "@" of an id.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ALIASES_FILE = "aliases.json"


def default_registry_dir() -> Path:
    """`<tokenmill cache>/registry`: moves with $TOKENMILL_CACHE, like the rest of tokenmill's cache."""
    from tokenmill.loader.default_model import cache_dir  # that module imports torch: only when needed

    return cache_dir() / "registry"


@dataclass(frozen=True)
class Version:
    """One stored, immutable version of a model."""

    manifest: Manifest
    folder: Path  # holds manifest.json and files/

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def id(self) -> str:
        """`name@version`."""
        return self.manifest.id

    @property
    def files_dir(self) -> Path:
        return self.folder / "files"

    @property
    def model_path(self) -> Path:
        """What to load: the HF folder (or a LoRA adapter's), or the .gguf file."""
        if self.manifest.format == "gguf":
            return self.files_dir / self.manifest.files[0].path
        return self.files_dir


def _check_name(value: str, what: str) -> None:
    if not _NAME_RE.fullmatch(value):
        raise RegistryError(
            f"{what} {value!r} is not allowed: use letters, digits, '.', '_' and '-' (starting with a letter "
            "or digit, at most 128 characters)"
        )


def _check_version(version: str) -> None:
    _check_name(version, "version")
    if version.isdigit() and version != str(int(version)):
        raise RegistryError(f"version {version!r} has leading zeros: write it as {int(version)}")


def _order_key(version: Version) -> tuple[int, int, str]:
    # Integer versions in numeric order, then the others by when they were added.
    if version.version.isdigit():
        return (0, int(version.version), "")
    return (1, 0, version.manifest.created)


class Registry:
    """Model versions and aliases in one folder, usable from any process (no server or Ray needed).

    Usage::

        registry = Registry()  # <tokenmill cache>/registry; Registry("/srv/models") for another folder
        registry.add("smol", "/models/SmolLM2-135M-Instruct")  # smol@1
        registry.add("smol", "/models/smol-ft", alias="smol-stable")  # smol@2, smol-stable -> smol@2
        registry.resolve("smol").model_path  # the highest version's folder (or .gguf), ready to load
    """

    def __init__(self, root: str | Path | None = None, lock_timeout_s: float | None = None) -> None:
        """`lock_timeout_s`: how long a write waits for another writer (RegistryBusyError past it; None:
        as long as it takes)."""
        self.root = Path(root).expanduser() if root is not None else default_registry_dir()
        self.lock_timeout_s = lock_timeout_s
        self._hashes = HashCache()

    # --- reading ---

    def list(self) -> builtins.list[Version]:
        """Every version, by name, then in version order (integers first, numerically)."""
        models = self.root / "models"
        names = sorted(p.name for p in models.iterdir() if p.is_dir()) if models.is_dir() else []
        return [v for name in names for v in self._versions(name)]

    def aliases(self) -> dict[str, str]:
        """alias -> `name@version`."""
        path = self.root / _ALIASES_FILE
        return dict(json.loads(path.read_text())) if path.is_file() else {}

    def aliases_of(self, version: Version) -> builtins.list[str]:
        return sorted(alias for alias, target in self.aliases().items() if target == version.id)

    def resolve(self, model_id: str) -> Version:
        """`name@version`, an alias, or a bare name: the alias called `name` if there is one (it pins the
        name's default version), else the name's highest version. Unknown ids raise UnknownModelError."""
        if "@" in model_id:
            name, _, version = model_id.partition("@")
            folder = self.root / "models" / name / version
            if _NAME_RE.fullmatch(name) and _NAME_RE.fullmatch(version) and (folder / MANIFEST_FILE).is_file():
                return Version(Manifest.read(folder), folder)
            raise self._unknown(model_id)
        aliases = self.aliases()
        if model_id in aliases:
            try:
                return self.resolve(aliases[model_id])
            except UnknownModelError:
                raise UnknownModelError(
                    f"alias {model_id!r} points at {aliases[model_id]}, which is not in the registry {self.root}: "
                    f"point it at another version or remove it"
                ) from None
        versions = self._versions(model_id) if _NAME_RE.fullmatch(model_id) else []
        if versions:
            return versions[-1]
        raise self._unknown(model_id)

    def show(self, model_id: str) -> Manifest:
        """The manifest of the version `model_id` resolves to."""
        return self.resolve(model_id).manifest

    def verify(self, version: Version | str) -> Version:
        """Check the version's files against its manifest: each listed file present, of its size and sha256,
        and no other file in its folder (the loader reads every *.safetensors there, listed or not).
        RegistryCorruptError names the first bad file (files in hidden folders are not checked). A file
        whose inode, mtime and size are unchanged since this Registry last hashed it is not read again."""
        if isinstance(version, str):
            version = self.resolve(version)
        fix = f"remove it (tokenmill models rm {version.id} --force) and add it again"
        listed = {entry.path for entry in version.manifest.files}
        # Hidden folders are not the version's: the loader's packed-weights cache (.tokenmill-packed/) lives
        # there, and it reads weights only from the top level.
        found = sorted(
            p.relative_to(version.files_dir).as_posix()
            for p in version.files_dir.rglob("*")
            if not any(part.startswith(".") for part in p.relative_to(version.files_dir).parts[:-1])
        )
        unlisted = [path for path in found if path not in listed and not (version.files_dir / path).is_dir()]
        if unlisted:
            raise RegistryCorruptError(
                f"{version.id} is corrupt: {unlisted[0]} is in its files but not in its manifest; {fix}"
            )
        for entry in version.manifest.files:
            path = version.files_dir / entry.path
            if not path.is_file():
                raise RegistryCorruptError(
                    f"{version.id} is corrupt: {entry.path} is missing from {path.parent}; {fix}"
                )
            size = path.stat().st_size
            if size != entry.size:
                raise RegistryCorruptError(
                    f"{version.id} is corrupt: {entry.path} has {size} bytes, its manifest says {entry.size}; {fix}"
                )
            if self._hashes.sha256(path) != entry.sha256:
                raise RegistryCorruptError(
                    f"{version.id} is corrupt: {entry.path}'s sha256 differs from its manifest's; {fix}"
                )
        return version

    # --- writing ---

    def add(
        self, name: str, path: str | Path, version: str | None = None, alias: str | None = None, copy: bool = False
    ) -> Version:
        """Store the HF folder, LoRA adapter folder or .gguf file at `path` as `name@version` (the next
        integer if left out).

        Files are hard-linked when the registry is on the same filesystem, else copied (`copy=True`: always
        copied). The version is built in a temporary folder and renamed into place, so it appears whole or
        not at all. An existing version is never replaced: adding it again is a RegistryError. The files are
        linked (or copied) and hashed before the write lock is taken: other writers wait only for the rename.
        """
        _check_name(name, "model name")
        if version is not None:
            _check_version(version)
        if alias is not None:
            _check_name(alias, "alias")
        source = Path(path).expanduser()
        if not source.exists():
            raise RegistryError(f"{source} does not exist: give a Hugging Face model folder or a .gguf file")
        info = describe(source)  # before any work: a bad path fails fast
        self._check_new(name, version, alias, self.aliases())
        with self._staging(name) as tmp:
            files = _store_files(source, tmp / "files", info.format == "gguf", copy)
            with self._writing():
                aliases = self.aliases()
                existing = self._check_new(name, version, alias, aliases)
                version = version or _next_integer(existing)
                created = datetime.now(timezone.utc).isoformat()  # microseconds: orders versions added in one second
                manifest = Manifest(
                    name=name,
                    version=version,
                    format=info.format,
                    architecture=info.architecture,
                    parameters=info.parameters,
                    dtype=info.dtype,
                    quantization=info.quantization,
                    context_length=info.context_length,
                    files=files,
                    created=created,
                    source=str(source.resolve()),
                    base_model=info.base_model,
                )
                manifest.write(tmp)
                target = self.root / "models" / name / version
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, target)
                if alias is not None:
                    write_json_atomic(self.root / _ALIASES_FILE, aliases | {alias: manifest.id})
        return Version(manifest, target)

    def _check_new(
        self, name: str, version: str | None, alias: str | None, aliases: dict[str, str]
    ) -> builtins.list[Version]:
        """RegistryError unless `name@version` may be added (with `alias`); returns the name's versions."""
        if name in aliases and aliases[name].partition("@")[0] != name:
            raise RegistryError(
                f"{name!r} is an alias of {aliases[name]}: pick another model name or remove the alias first"
            )
        existing = self._versions(name)
        if version is not None and any(v.version == version for v in existing):
            raise RegistryError(
                f"{name}@{version} already exists and versions are immutable: give another --version, or "
                f"leave it out for the next one ({name}@{_next_integer(existing)})"
            )
        if alias is not None:
            self._check_alias_target(alias, name)
        return existing

    def set_alias(self, alias: str, model_id: str) -> Version:
        """Point `alias` at the version `model_id` resolves to (pinned: a later version does not move it).

        An alias may not take another model's name; an alias named like its own model pins that name's
        default version (bare `name` resolves through it)."""
        _check_name(alias, "alias")
        with self._writing():
            version = self.resolve(model_id)
            self._check_alias_target(alias, version.name)
            write_json_atomic(self.root / _ALIASES_FILE, self.aliases() | {alias: version.id})
        return version

    def remove_alias(self, alias: str) -> None:
        with self._writing():
            aliases = self.aliases()
            if alias not in aliases:
                known = ", ".join(sorted(aliases)) or "none"
                raise UnknownModelError(f"no alias {alias!r} in the registry {self.root} (aliases: {known})")
            del aliases[alias]
            write_json_atomic(self.root / _ALIASES_FILE, aliases)

    def remove(self, model_id: str, force: bool = False) -> builtins.list[Version]:
        """Delete `name@version`, or every version of a bare `name`. A version an alias points at is kept
        (RegistryError) unless `force`, which removes those aliases too. Returns what was removed."""
        with self._writing():
            aliases = self.aliases()
            if "@" in model_id:
                doomed = [self.resolve(model_id)]
            elif model_id in aliases and not self._versions(model_id):
                raise RegistryError(
                    f"{model_id!r} is an alias of {aliases[model_id]}, not a model: remove the alias with "
                    f"`tokenmill models alias --remove {model_id}` (Registry.remove_alias)"
                )
            else:
                doomed = self._versions(model_id) if _NAME_RE.fullmatch(model_id) else []
                if not doomed:
                    raise self._unknown(model_id)
            ids = {v.id for v in doomed}
            pointing = {a: t for a, t in aliases.items() if t in ids}
            if pointing and not force:
                held = ", ".join(f"{a} -> {t}" for a, t in sorted(pointing.items()))
                raise RegistryError(
                    f"cannot remove {model_id}: aliases point at it ({held}); point them elsewhere first, "
                    "or force (--force) to remove them too"
                )
            if pointing:  # aliases first: a crash then leaves versions without aliases, never dangling aliases
                write_json_atomic(self.root / _ALIASES_FILE, {a: t for a, t in aliases.items() if a not in pointing})
            for version in doomed:
                # Renamed out whole, then deleted: a crash never leaves half a version in models/.
                trash = Path(tempfile.mkdtemp(dir=self._tmp_dir(), prefix=f"rm-{version.name}-"))
                os.rename(version.folder, trash / "version")
                shutil.rmtree(trash)
            _rmdir_if_empty(self.root / "models" / doomed[0].name)
        return doomed

    # --- helpers ---

    def _versions(self, name: str) -> builtins.list[Version]:
        folder = self.root / "models" / name
        if not folder.is_dir():
            return []
        found = [Version(Manifest.read(p), p) for p in folder.iterdir() if (p / MANIFEST_FILE).is_file()]
        return sorted(found, key=_order_key)

    def _check_alias_target(self, alias: str, name: str) -> None:
        if alias != name and self._versions(alias):
            raise RegistryError(f"alias {alias!r} would hide the model {alias!r}: pick another alias name")

    def _unknown(self, model_id: str) -> UnknownModelError:
        held = [v.id for v in self.list()] + [f"{a} (-> {t})" for a, t in sorted(self.aliases().items())]
        if not held:
            return UnknownModelError(
                f"no model {model_id!r}: the registry {self.root} is empty; "
                "add one with `tokenmill models add NAME PATH`"
            )
        listing = ", ".join(held)
        return UnknownModelError(
            f"no model, version or alias {model_id!r} in the registry {self.root}; it holds: {listing}"
        )

    def _tmp_dir(self) -> Path:
        tmp = self.root / ".tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    @contextmanager
    def _staging(self, name: str) -> Iterator[Path]:
        """A folder in .tmp/ to build a version in, flock'ed while this writer lives: another writer's clean-up
        leaves it alone, and removes it once its builder has died. Gone afterwards (renamed, or deleted)."""
        with self._writing():  # created under the write lock: no clean-up can take it before it is flock'ed
            tmp = Path(tempfile.mkdtemp(dir=self._tmp_dir(), prefix=f"add-{name}-"))
            fd = os.open(tmp, os.O_RDONLY)
            try_flock(fd)
        try:
            yield tmp
        finally:
            os.close(fd)  # drops the flock
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """The write lock (RegistryBusyError past the lock timeout). Writers delete and rename only inside it,
        and a staging folder is flock'ed by its live builder, so whatever in .tmp/ no one holds when the lock
        is taken was left by a writer that crashed: clear it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(self.root / ".lock", self.lock_timeout_s):
            for leftover in self._tmp_dir().iterdir():
                _remove_if_abandoned(leftover)
            yield


def _remove_if_abandoned(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # gone meanwhile
    try:
        if try_flock(fd):  # no live writer holds it
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)


def _next_integer(existing: builtins.list[Version]) -> str:
    return str(max((int(v.version) for v in existing if v.version.isdigit()), default=0) + 1)


def _store_files(source: Path, dest: Path, is_gguf: bool, copy: bool) -> tuple[FileEntry, ...]:
    """Link (or copy) the checkpoint's files into dest and record each one's size and sha256. An HF folder
    contributes its top-level files; subfolders and hidden files (caches, `original/` checkpoints) stay out."""
    dest.mkdir()
    sources = [source] if is_gguf else sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
    entries = []
    for src in sources:
        link_or_copy(src, dest / src.name, copy)
        stored = dest / src.name
        entries.append(FileEntry(path=src.name, size=stored.stat().st_size, sha256=sha256_of(stored)))
    return tuple(entries)


def _rmdir_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty, or already gone
