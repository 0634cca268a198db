"""The model pool's settings: where models come from and what may stay resident."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ACCESS_FILE = "access.json"  # in the registry's folder: API key -> the models it may use


@dataclass(frozen=True)
class PoolConfig:
    """Serving several models beside the default one (`tokenmill serve --registry DIR`, `--extra-model`)."""

    registry: str | None = None  # a registry folder: every version and alias in it is servable
    extra_models: tuple[tuple[str, str], ...] = ()  # (name, path) pairs served beside the default model
    keep_alive_s: float | None = None  # a model idle this long is unloaded; None: models stay loaded
    max_loaded_models: int | None = None  # resident engines, the default model included; None: no bound
    memory_budget_gb: float | None = None  # estimated weights + KV cache of resident models, in GiB
    admin_key: str | None = None  # the key of the /admin routes; None: they answer 401
    access_file: str | None = None  # API key -> models; default: the registry's access.json, if present

    def __post_init__(self) -> None:
        if self.keep_alive_s is not None and not self.keep_alive_s > 0:
            raise ValueError("--keep-alive must be a positive number of seconds")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError("--max-loaded-models must be at least 1 (the default model counts as one)")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError("--memory-budget-gb must be a positive number")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("--admin-key must not be empty")
        names = [name for name, _ in self.extra_models]
        if len(set(names)) != len(names):
            raise ValueError("--extra-model names must differ from each other")

    @property
    def enabled(self) -> bool:
        """Whether the server routes requests by their `model` field to several engines."""
        return self.registry is not None or bool(self.extra_models)

    def access_path(self) -> Path | None:
        """The access config in force: --access-config, else the registry's access.json if it exists."""
        if self.access_file is not None:
            return Path(self.access_file).expanduser()
        if self.registry is not None:
            path = Path(self.registry).expanduser() / ACCESS_FILE
            return path if path.is_file() else None
        return None


def parse_extra_model(value: str) -> tuple[str, str]:
    """`NAME=PATH` from the command line."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--extra-model takes NAME=PATH, got {value!r}")
    return name.strip(), path.strip()
