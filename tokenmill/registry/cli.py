"""`tokenmill models <subcommand>`: the model registry from the command line.

    tokenmill models add smol ./SmolLM2-135M-Instruct --alias smol-stable   # smol@1
    tokenmill models add smol ./smol-q4.gguf --version q4                    # smol@q4
    tokenmill models list [--json]
    tokenmill models show smol-stable [--json]
    tokenmill models alias smol-stable smol@q4        # --remove to delete an alias
    tokenmill models rm smol@1 [--force]
    tokenmill models verify smol                      # re-hash the files against the manifest

Every subcommand takes `--registry DIR` (default: <tokenmill cache>/registry). Registry errors print one
line on stderr and exit 1; usage errors exit 2 (argparse).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from tokenmill.registry.errors import RegistryError
from tokenmill.registry.store import Registry, Version


def add_models_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add `models` (with its own subcommands) to the top-level `tokenmill` subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=None, help="registry folder (default: <tokenmill cache>/registry)")
    models = subparsers.add_parser("models", help="the model registry: add, list, show, rm, alias, verify")
    sub = models.add_subparsers(dest="models_command", required=True)

    add = sub.add_parser("add", parents=[common], help="store an HF folder or .gguf as NAME@VERSION")
    add.add_argument("name")
    add.add_argument("path", help="a Hugging Face model folder or a .gguf file")
    add.add_argument("--version", default=None, help="default: the next integer (1, 2, ...)")
    add.add_argument("--alias", default=None, help="also point this alias at the new version")
    add.add_argument("--copy", action="store_true", help="copy the files even where hard links would work")
    add.set_defaults(func=_run(_add))

    lst = sub.add_parser("list", parents=[common], help="every version, with its aliases")
    lst.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    lst.set_defaults(func=_run(_list))

    show = sub.add_parser("show", parents=[common], help="the manifest of NAME@VERSION, an alias or NAME")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_run(_show))

    rm = sub.add_parser("rm", parents=[common], help="remove NAME@VERSION, or every version of NAME")
    rm.add_argument("id")
    rm.add_argument("--force", action="store_true", help="also remove the aliases that point at it")
    rm.set_defaults(func=_run(_rm))

    alias = sub.add_parser("alias", parents=[common], help="point ALIAS at the version ID resolves to")
    alias.add_argument("alias")
    alias.add_argument("id", nargs="?", help="NAME@VERSION, another alias, or NAME (its highest version)")
    alias.add_argument("--remove", action="store_true", help="delete ALIAS instead")
    alias.set_defaults(func=_run(_alias))

    verify = sub.add_parser("verify", parents=[common], help="re-hash a version's files against its manifest")
    verify.add_argument("id")
    verify.set_defaults(func=_run(_verify))
    return models


def _run(handler: Callable[[Registry, argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """The registry's errors (and the file system's) as one line on stderr and exit code 1, no traceback."""

    def run(args: argparse.Namespace) -> None:
        try:
            handler(Registry(args.registry), args)
        except (RegistryError, OSError) as exc:
            print(f"tokenmill models: error: {exc}", file=sys.stderr)
            sys.exit(1)

    return run


def _add(registry: Registry, args: argparse.Namespace) -> None:
    version = registry.add(args.name, args.path, version=args.version, alias=args.alias, copy=args.copy)
    m = version.manifest
    alias = f", alias {args.alias}" if args.alias else ""
    base = f" (of {m.base_model})" if m.base_model else ""
    print(f"added {version.id}{alias}: {m.architecture}{base}, {_count(m.parameters)} parameters, {_bytes(m.size)}")


def _list(registry: Registry, args: argparse.Namespace) -> None:
    versions = registry.list()
    if args.json:
        print(json.dumps([_entry(registry, v) for v in versions], indent=2))
        return
    if not versions:
        print(f"the registry {registry.root} is empty: add a model with `tokenmill models add NAME PATH`")
        return
    header = ("ID", "ARCHITECTURE", "PARAMS", "DTYPE", "CONTEXT", "SIZE", "CREATED", "ALIASES")
    rows = [header] + [_row(registry, v) for v in versions]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _show(registry: Registry, args: argparse.Namespace) -> None:
    version = registry.resolve(args.id)
    entry = _entry(registry, version)
    if args.json:
        print(json.dumps(entry, indent=2))
        return
    files = entry.pop("files")
    for key, value in entry.items():
        text = ", ".join(value) if isinstance(value, list) else str(value) if value is not None else ""
        print(f"{key + ':':16}{text or '-'}")
    print("files:")
    width = max(len(f["path"]) for f in files)
    for f in files:
        print(f"  {f['path']:{width}}  {_bytes(f['size']):>10}  sha256 {f['sha256']}")


def _rm(registry: Registry, args: argparse.Namespace) -> None:
    for version in registry.remove(args.id, force=args.force):
        print(f"removed {version.id}")


def _alias(registry: Registry, args: argparse.Namespace) -> None:
    if args.remove:
        if args.id is not None:
            raise RegistryError("--remove takes only the alias: tokenmill models alias --remove ALIAS")
        registry.remove_alias(args.alias)
        print(f"removed alias {args.alias}")
        return
    if args.id is None:
        raise RegistryError("name the version: tokenmill models alias ALIAS NAME@VERSION (or --remove ALIAS)")
    version = registry.set_alias(args.alias, args.id)
    print(f"{args.alias} -> {version.id}")


def _verify(registry: Registry, args: argparse.Namespace) -> None:
    version = registry.verify(args.id)
    print(f"{version.id}: {len(version.manifest.files)} files match the manifest")


def _entry(registry: Registry, version: Version) -> dict[str, Any]:
    """A version as JSON: the manifest, plus where it lives, its total size and its aliases."""
    manifest = version.manifest.to_dict()
    return (
        {"id": version.id}
        | manifest
        | {
            "size": version.manifest.size,
            "path": str(version.model_path),
            "aliases": registry.aliases_of(version),
        }
    )


def _row(registry: Registry, version: Version) -> tuple[str, ...]:
    m = version.manifest
    return (
        version.id,
        m.architecture,
        _count(m.parameters),
        m.dtype,
        str(m.context_length) if m.context_length is not None else "-",
        _bytes(m.size),
        m.created.replace("T", " ")[:16],  # to the minute
        ", ".join(registry.aliases_of(version)) or "-",
    )


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
