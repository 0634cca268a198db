"""Settings declared once: a config dataclass field carries its help, group, choices and parser, and the
command-line flags and the `--config FILE.yaml` keys of every command are generated from it.

A field's flag is its name with dashes (`max_num_seqs` -> `--max-num-seqs`); `aliases` keeps an established
spelling working as the same flag (`--api-key` for `api_keys`). Booleans get `--x / --no-x`, tuples take the
flag repeatedly or comma-separated. A leaf: imports nothing of the package, so every config module may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUPS = {
    "model": "model: what to load and in which precision",
    "cache": "cache: the paged KV cache",
    "scheduler": "scheduler: batch sizes and order",
    "parallel": "parallel: tensor-parallel ranks",
    "quantization": "quantization: weights stored in fewer bits",
    "speculative": "speculative decoding",
    "lora": "LoRA: fine-tuned adapters over the base model, batched together",
    "network": "network: address and TLS",
    "auth": "auth: API keys and who may do what",
    "limits": "limits: what one request or client may ask",
    "timeouts": "timeouts: deadlines of requests, reads and shutdown",
    "observability": "observability: logs, traces, metrics and the dashboard",
    "models": "models: several models behind one endpoint (requests pick one by `model`)",
    "tools": "tools: tool calls in free text",
    "batch": "batch: the Batch API's files and its runner",
}
CONFIG_FLAG = "--config"


@dataclass(frozen=True)
class Setting:
    """What a field needs to become a flag. `parse` turns one command-line string (or one YAML value) into
    the field's value; default: the field's scalar type."""

    help: str
    group: str
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    aliases: tuple[str, ...] = ()


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    parse: Callable[[Any], Any] | None = None,
    aliases: tuple[str, ...] = (),
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also a flag (see the module docstring)."""
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}; use one of {list(GROUPS)}.")
    meta = {"setting": Setting(help, group, choices, metavar, parse, aliases)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_of(cls: type) -> list[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of a config dataclass that are flags, in declaration order."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def _kind(field: dataclasses.Field[Any]) -> str:
    """ "bool", "tuple" or "scalar", read from the annotation (a string under `from __future__ import
    annotations`)."""
    annotation = str(field.type)
    if annotation == "bool":
        return "bool"
    return "tuple" if annotation.startswith("tuple[") else "scalar"


def _scalar_parser(field: dataclasses.Field[Any], spec: Setting) -> Callable[[Any], Any]:
    if spec.parse is not None:
        return spec.parse
    annotation = str(field.type)
    for name, parse in (("int", int), ("float", float)):
        if annotation == name or annotation.startswith(name + " |"):
            return parse
    return str


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of `cls`, each in its group's argument group (created once per parser)."""
    groups: dict[str, argparse._ArgumentGroup] = {g.title: g for g in parser._action_groups if g.title}  # type: ignore[misc]
    for field, spec in settings_of(cls):
        title = GROUPS[spec.group]
        group = groups.get(title) or parser.add_argument_group(title)
        groups[title] = group
        names = [flag_name(field.name), *spec.aliases]
        kind = _kind(field)
        default = _default(field)
        if kind == "bool":
            group.add_argument(
                *names, dest=field.name, action=argparse.BooleanOptionalAction, default=default, help=spec.help
            )
        elif kind == "tuple":
            group.add_argument(
                *names, dest=field.name, action="append", default=None, metavar=spec.metavar, help=spec.help
            )
        else:
            group.add_argument(
                *names,
                dest=field.name,
                type=_scalar_parser(field, spec),
                default=default,
                choices=spec.choices,
                metavar=spec.metavar,
                help=spec.help,
            )


def _tuple_value(field: dataclasses.Field[Any], spec: Setting, values: Any) -> tuple[Any, ...]:
    """Repeated flags or a YAML list, each item comma-separated unless the field parses items itself."""
    if values is None:
        return tuple(_default(field))
    items = [values] if isinstance(values, str) else list(values)
    if spec.parse is None:
        items = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    return tuple(spec.parse(item) if spec.parse else item for item in items)


def from_namespace(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """Build `cls` from parsed flags (fields without a flag keep their defaults unless given in `extra`)."""
    values: dict[str, Any] = {}
    for field, spec in settings_of(cls):
        if not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        values[field.name] = _tuple_value(field, spec, value) if _kind(field) == "tuple" else value
    return cls(**values, **extra)


def add_config_flag(parser: argparse.ArgumentParser, classes: Sequence[type]) -> None:
    """`--config FILE.yaml` on `parser`, whose keys are the settings of `classes` (see `parse_args`)."""
    parser.set_defaults(config_classes=tuple(classes), config_parser=parser)
    parser.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="FILE.yaml",
        help="settings from a YAML file, keyed by the flags' names (dashes or underscores); flags win",
    )


def add_help_group_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--help-group",
        action=_HelpGroup,
        choices=list(GROUPS),
        metavar="GROUP",
        help="show the flags of one group and exit",
    )


class _HelpGroup(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        formatter = parser._get_formatter()
        for group in parser._action_groups:
            if group.title == GROUPS[values]:
                formatter.start_section(group.title)
                formatter.add_arguments(group._group_actions)
                formatter.end_section()
        parser._print_message(formatter.format_help(), sys.stdout)
        parser.exit()


def load_config_file(path: str, classes: Sequence[type]) -> dict[str, Any]:
    """The YAML file's settings as flag defaults, parsed as their flags would be; an unknown key or a bad
    value is a ValueError that names it."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"the config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"the config file {path} must hold a mapping of setting names to values.")
    known = {field.name: (field, spec) for cls in classes for field, spec in settings_of(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown setting {key!r} in {path}; known: {', '.join(sorted(known))}.")
        field, spec = known[name]
        try:
            values[name] = _file_value(field, spec, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"setting {key!r} in {path}: {exc}") from exc
    return values


def _file_value(field: dataclasses.Field[Any], spec: Setting, value: Any) -> Any:
    kind = _kind(field)
    if value is None or kind == "tuple":  # tuples: kept as a list, split and parsed by from_namespace
        return value if value is None or isinstance(value, list) else [value]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    parsed = _scalar_parser(field, spec)(value)
    if spec.choices is not None and parsed not in spec.choices:
        raise ValueError(f"{parsed!r} is not one of {list(spec.choices)}")
    return parsed


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse `argv`; when it names `--config FILE`, parse again with the file's settings as the defaults of
    the command that took the flag, so that flags on the command line win over the file."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path:
        command: argparse.ArgumentParser = args.config_parser
        try:
            defaults = load_config_file(path, args.config_classes)
        except ValueError as exc:
            command.error(str(exc))
        command.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return _without_bookkeeping(args)


def _without_bookkeeping(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace without what add_config_flag keeps for parse_args (not settings: never reported)."""
    for name in ("config_classes", "config_parser"):
        if hasattr(args, name):
            delattr(args, name)
    return args
