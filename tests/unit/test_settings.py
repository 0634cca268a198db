"""Settings have one source: every EngineArgs / ServerConfig / PoolConfig field is exactly one `tokenmill serve`
flag, and `--config FILE.yaml` with the same keys gives the same configs as the flags."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tokenmill.config import EngineArgs
from tokenmill.server.cli import add_serve_parser, engine_and_server_config
from tokenmill.server.config import PoolConfig, ServerConfig
from tokenmill.settings import GROUPS, flag_name, parse_args

# Flags that are not a config field: the positional model, the config file, the help switches.
NOT_FIELDS = {"help", "model_path", "config", "help_group"}


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tokenmill")
    add_serve_parser(root.add_subparsers(dest="command"))
    return root


def _serve_actions() -> list[argparse.Action]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices["serve"]._actions)


def _configs(argv: list[str]) -> tuple[EngineArgs, ServerConfig]:
    return engine_and_server_config(parse_args(_parser(), ["serve", *argv]))


def test_every_field_has_exactly_one_flag_and_every_flag_a_field() -> None:
    fields = [f.name for cls in (EngineArgs, ServerConfig, PoolConfig) for f in dataclasses.fields(cls)]
    fields.remove("models")  # ServerConfig.models is PoolConfig, whose own fields are the flags
    dests = [a.dest for a in _serve_actions() if a.dest not in NOT_FIELDS]
    assert sorted(dests) == sorted(fields)
    for action in _serve_actions():
        if action.dest not in NOT_FIELDS:
            assert flag_name(action.dest) in action.option_strings  # the flag is the field's name


def test_flags_sit_in_their_groups() -> None:
    serve = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    titles = {g.title for g in serve._action_groups}
    for group in ("model", "cache", "scheduler", "parallel", "network", "auth", "limits", "timeouts", "models"):
        assert GROUPS[group] in titles
    help_text = serve.format_help()
    assert GROUPS["timeouts"] + ":" in help_text and "--header-read-timeout-s" in help_text


def test_config_file_and_flags_give_the_same_configs(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "max_num_seqs: 7\n"
        "enable-prefix-caching: false\n"
        "speculative_config: {method: ngram, num_speculative_tokens: 3}\n"
        "port: 9001\n"
        "allowed_hosts: [a.com, b.com]\n"
        "max_tokens: 99\n"
        "memory_pressure_threshold: 0\n"
        "dashboard: false\n"
        "extra_models: [other=/models/other]\n"
        "keep_alive_s: 12.5\n"
    )
    from_file = _configs(["--config", str(config)])
    from_flags = _configs(
        [
            "--max-num-seqs", "7", "--no-enable-prefix-caching",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--port", "9001", "--allowed-hosts", "a.com,b.com", "--max-tokens-limit", "99",
            "--memory-pressure-threshold", "0", "--no-dashboard", "--extra-model", "other=/models/other",
            "--keep-alive", "12.5",
        ]
    )  # fmt: skip
    assert from_file == from_flags
    engine, server = from_file
    assert engine.max_num_seqs == 7 and engine.enable_prefix_caching is False
    assert server.allowed_hosts == ("a.com", "b.com") and server.memory_pressure_threshold is None
    assert server.models.extra_models == (("other", "/models/other"),) and server.models.keep_alive_s == 12.5
    assert from_file != _configs([])


def test_flags_win_over_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 7\nport: 9001\n")
    engine, server = _configs(["--config", str(config), "--port", "9002"])
    assert (engine.max_num_seqs, server.port) == (7, 9002)
    engine, server = _configs(["--port", "9003", "--config", str(config)])
    assert server.port == 9003


def test_an_unknown_config_key_is_a_usage_error_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seq: 7\n")
    with pytest.raises(SystemExit):
        _configs(["--config", str(config)])
    assert "unknown setting 'max_num_seq'" in capsys.readouterr().err


def test_a_bad_config_value_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("prefix_cache_isolation: everyone\n")
    with pytest.raises(SystemExit):
        _configs(["--config", str(config)])
    assert "prefix_cache_isolation" in capsys.readouterr().err


def test_help_group_shows_one_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(_parser(), ["serve", "--help-group", "auth"])
    out = capsys.readouterr().out
    assert "--api-keys" in out and "--max-num-seqs" not in out
