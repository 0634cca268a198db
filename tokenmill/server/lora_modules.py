"""The LoRA adapters a server serves by name: `--lora-modules NAME=PATH ...` at start, and at runtime
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes). A request's `model` names the
base model or an adapter; /v1/models lists each adapter with the base as its `parent`.

An adapter is named by its folder, or by its id in the model registry (`tokenmill models add NAME
ADAPTER_FOLDER`: name, name@version or an alias), where no folder of that name exists.

Each load gets a new int id, so an adapter unloaded and loaded again from another folder never reuses
the old one's slot in the runner; its prefix-cache blocks are keyed by name and folder."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.lora_request import LoRARequest


def parse_lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH (a --lora-modules entry) as (name, path); ValueError for anything else."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes NAME=PATH entries, got {value!r}.")
    return name.strip(), path.strip()


class LoRAModules:
    def __init__(self, engine: AsyncEngine, base_name: str, registry_dir: str | None = None) -> None:
        """`registry_dir`: the registry adapters are looked up in by id (None: the default one)."""
        self.engine = engine
        self.base_name = base_name
        self.registry_dir = registry_dir
        self.by_name: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}  # when each was loaded (its model card's `created`)
        self._ids = itertools.count(1)

    def check_new(self, name: str, path: str) -> None:
        """A ValueError that says what is wrong with serving the adapter in `path` as `name` (a name taken,
        a missing or malformed adapter, a rank above the limit, another base model); reads its files."""
        if not name or name == self.base_name:
            raise ValueError(f"the adapter name {name!r} is taken by the base model; choose another.")
        if name in self.by_name:
            raise ValueError(f"an adapter named {name!r} is loaded already; unload it first.")
        if self.engine.loras is None:
            raise ValueError("this server serves no LoRA adapters: start it with --enable-lora.")
        self.engine.loras.check(LoRARequest(name, 1, self.folder(path)))

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in `path` as `name` (checked first: check_new's ValueError)."""
        self.check_new(name, path)  # the folder's checks run once (AdapterChecker): here the name's again
        lora = LoRARequest(name, next(self._ids), self.folder(path))
        self.by_name[name] = lora
        self.created[name] = int(time.time())
        return lora

    def folder(self, path: str) -> str:
        """The adapter's folder: `path` itself, or where no such folder exists, the files of the registry's
        adapter version it names. A ValueError when it is neither, or names a model in the registry."""
        folder = Path(path).expanduser()
        if folder.exists() or "/" in path:
            return str(folder.resolve())
        from tokenmill.registry import Registry, RegistryError  # only for ids: its default folder imports torch

        registry = Registry(self.registry_dir)
        try:
            version = registry.resolve(path)
        except RegistryError:
            raise ValueError(
                f"{path!r} is neither a LoRA adapter folder nor an adapter in the model registry {registry.root}."
            ) from None
        if version.manifest.format != "lora":
            raise ValueError(f"{version.id} in the model registry is a model, not a LoRA adapter.")
        return str(version.files_dir)

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    async def unload(self, name: str, timeout_s: float) -> int:
        """Stop serving `name` at once (new requests for it get 404), then wait up to `timeout_s` for its
        requests in flight to finish; those still running then are aborted. Returns how many were.
        KeyError for an adapter that is not loaded."""
        lora = self.by_name.pop(name)
        self.created.pop(name, None)
        if self.engine.loras is not None:
            self.engine.loras.forget(lora)
        deadline = time.monotonic() + timeout_s
        while self._in_flight(lora) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        late = self._in_flight(lora)
        for request_id in late:
            self.engine.abort(request_id)
        return len(late)

    def _in_flight(self, lora: LoRARequest) -> list[str]:
        return [
            request_id
            for request_id, stream in self.engine.streams.items()
            if any(child.lora_request == lora for child in stream.children)
        ]
