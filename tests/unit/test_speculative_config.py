"""Speculative decoding's configuration, in vLLM's shape: `LLM(..., speculative_config={...})` and
`--speculative-config '<json>'` on serve, generate, chat and bench throughput reach EngineConfig.speculative;
a bad one is a ValueError at start-up (an argparse usage error on the command line), never a traceback
from inside the engine."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest

import tokenmill.cli
import tokenmill.engine.llm
import tokenmill.server.launcher
from tokenmill import LLM
from tokenmill.config import EngineArgs, EngineConfig, SpeculativeConfig
from tokenmill.engine.engine_args import (
    add_engine_args,
    create_engine_config,
    describe_speculative,
    engine_kwargs,
    resolve_speculative,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# vLLM's documented n-gram example (docs.vllm.ai, "Speculative Decoding", n-gram).
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
PRESET = {"model": "smollm2-135m", "load_format": "dummy"}  # a config without files or weights


def _config(**kwargs: Any) -> EngineConfig:
    config, _ = create_engine_config(EngineArgs(**PRESET, **kwargs))
    return config


# ---------------------------------------------------------------------- EngineArgs -> EngineConfig
def test_no_speculative_config_leaves_speculation_off() -> None:
    assert _config().speculative is None


def test_a_dict_in_vllms_shape_becomes_a_speculative_config() -> None:
    spec = _config(speculative_config=VLLM_NGRAM).speculative
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)


def test_a_speculative_config_object_is_taken_as_it_is() -> None:
    given = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert _config(speculative_config=given).speculative is given


def test_a_draft_model_config_keeps_the_drafts_path() -> None:
    spec = _config(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "d"}).speculative
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "d", 2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 4}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 4, "num_lookahead": 2}, "unknown speculative_config keys"),
        ({"num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "model"),
    ],
    ids=["k=0", "k<0", "k-float", "unknown-method", "unknown-key", "no-method", "no-k", "draft-without-model"],
)
def test_a_bad_config_is_a_value_error_at_start_up(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(speculative_config=spec)


def test_a_config_that_is_not_a_dict_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        resolve_speculative('{"method": "ngram"}')  # type: ignore[arg-type]


def test_llm_passes_speculative_config_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineConfig] = []

    class Built(Exception):
        pass

    def engine_core(config: EngineConfig, *args: object) -> None:
        seen.append(config)
        raise Built  # stop before a model is built

    monkeypatch.setattr(tokenmill.engine.llm, "EngineCore", engine_core)
    with pytest.raises(Built):
        LLM(**PRESET, speculative_config=NGRAM)
    assert seen[0].speculative == SpeculativeConfig.from_dict(NGRAM)


def test_llm_refuses_a_bad_speculative_config_before_loading_anything() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(**PRESET, speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_the_engine_ready_line_names_the_method_and_k() -> None:
    assert describe_speculative(None) == "off"
    described = describe_speculative(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    assert described.startswith("ngram k=4")


# ---------------------------------------------------------------------- --speculative-config
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill test")
    add_engine_args(parser)
    return parser


def test_the_flag_is_parsed_to_a_dict_that_reaches_engine_args() -> None:
    args = _parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == NGRAM
    assert EngineArgs(**engine_kwargs(args)).speculative_config == NGRAM


def test_without_the_flag_speculation_is_off() -> None:
    assert engine_kwargs(_parser().parse_args([]))["speculative_config"] is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{method: ngram}", "not valid JSON"),
        ('["ngram", 4]', "must be a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "k": 4}', "unknown speculative_config keys"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "unknown speculative method"),
    ],
    ids=["bad-json", "not-an-object", "k=0", "unknown-key", "unknown-method"],
)
def test_a_bad_flag_is_a_usage_error_naming_the_flag(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--speculative-config", text])
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


class _Captured(Exception):
    """Raised where a command would build its engine: the test has what it needs."""


@pytest.mark.parametrize("command", ["generate", "chat", "bench throughput"])
def test_offline_commands_give_the_flag_to_their_engine(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineArgs] = []

    def capture(args: EngineArgs) -> None:
        seen.append(args)
        raise _Captured

    monkeypatch.setattr(tokenmill.engine.llm, "create_engine_config", capture)
    with pytest.raises(_Captured):
        tokenmill.cli.main(
            [*command.split(), "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
        )
    assert seen[0].speculative_config == NGRAM


def test_serve_gives_the_flag_to_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineArgs] = []
    monkeypatch.setattr(tokenmill.server.launcher, "serve", lambda args, *rest: seen.append(args))
    package_logger = logging.getLogger("tokenmill")
    monkeypatch.setattr(package_logger, "level", package_logger.level)  # serve sets it from --log-level
    tokenmill.cli.main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert seen[0].speculative_config == NGRAM
