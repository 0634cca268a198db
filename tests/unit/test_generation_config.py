"""A model's sampling defaults from its generation_config.json (vLLM's --generation-config), and their
precedence: a request's explicit value, then the model's default, then OpenAI's (or the CLI's). Through an
engine (the engine config, the offline API): tests/e2e/test_generation_config_e2e.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import _sampling_params
from tokenmill.loader.default_model import DEFAULT_MODEL_SAMPLING, _add_model_card_sampling
from tokenmill.loader.generation_config import load_sampling_defaults, parse_sampling_defaults
from tokenmill.sampling_params import OPENAI_SAMPLING_DEFAULTS, with_defaults
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.sampling import sampling_params

# A generation_config.json as Qwen2.5-Instruct ships it: token ids, do_sample, and the sampling keys.
QWEN_STYLE = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


def write_generation_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------------- reading the file


def test_auto_reads_the_sampling_keys_of_the_model_folder(tmp_path: Path) -> None:
    write_generation_config(tmp_path, QWEN_STYLE)
    assert load_sampling_defaults("auto", tmp_path) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


def test_max_new_tokens_becomes_the_max_tokens_default() -> None:
    assert parse_sampling_defaults({"max_new_tokens": 256, "min_p": 0.05}) == {"max_tokens": 256, "min_p": 0.05}


def test_absent_and_null_keys_are_left_out() -> None:
    assert parse_sampling_defaults({"temperature": 0.6, "top_p": None, "eos_token_id": 2}) == {"temperature": 0.6}


def test_do_sample_false_keeps_the_files_temperature() -> None:
    # As vLLM: do_sample is not a sampling default; the file's temperature applies as written.
    assert parse_sampling_defaults({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.6}


def test_auto_without_a_file_has_no_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults("auto", tmp_path) == {}
    assert load_sampling_defaults("auto", None) == {}  # a dummy preset has no folder


def test_vllm_ignores_the_models_file(tmp_path: Path) -> None:
    write_generation_config(tmp_path, QWEN_STYLE)
    assert load_sampling_defaults("vllm", tmp_path) == {}


def test_a_folder_is_read_instead_of_the_models(tmp_path: Path) -> None:
    model = write_generation_config(tmp_path / "model", QWEN_STYLE)
    override = write_generation_config(tmp_path / "override", {"temperature": 0.0})
    assert load_sampling_defaults(str(override), model) == {"temperature": 0.0}


def test_a_folder_without_the_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        load_sampling_defaults(str(tmp_path), None)


def test_a_file_that_is_not_json_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{temperature: 0.2")
    with pytest.raises(ValueError, match="cannot read .*generation_config.json"):
        load_sampling_defaults("auto", tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"temperature": "low"}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"max_new_tokens": 0}, "max_tokens must be an integer >= 1"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_file(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_sampling_defaults(config, "/models/x/generation_config.json")
    assert "/models/x/generation_config.json" in str(err.value)


# ---------------------------------------------------------------------- precedence


def test_an_explicit_value_wins_over_the_models_default() -> None:
    assert with_defaults({"temperature": 1.0}, {"temperature": 0.2}, OPENAI_SAMPLING_DEFAULTS) == {"temperature": 1.0}


def test_the_models_default_fills_a_field_left_out() -> None:
    assert with_defaults({"temperature": None}, {"temperature": 0.2}, OPENAI_SAMPLING_DEFAULTS) == {"temperature": 0.2}


def test_openais_default_fills_a_field_neither_sets() -> None:
    assert with_defaults({"top_p": None}, {"temperature": 0.2}, OPENAI_SAMPLING_DEFAULTS) == {"top_p": 1.0}


def test_an_explicit_zero_is_not_left_out() -> None:
    assert with_defaults({"temperature": 0.0}, {"temperature": 0.2}) == {"temperature": 0.0}


def test_only_the_fields_asked_for_are_resolved() -> None:
    assert with_defaults({"temperature": None}, {"temperature": 0.2, "max_tokens": 99}) == {"temperature": 0.2}


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


def test_a_chat_request_without_sampling_fields_gets_the_models_defaults() -> None:
    params = sampling_params(chat_request(), 16, None, None, {"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 0)  # top_k: OpenAI's (none)


def test_a_chat_requests_explicit_temperature_wins() -> None:
    params = sampling_params(chat_request(temperature=1.0), 16, None, None, {"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p) == (1.0, 0.9)


def test_a_chat_request_gets_openais_defaults_when_the_model_has_none() -> None:
    params = sampling_params(chat_request(), 16, None, None, {})
    assert (params.temperature, params.top_p, params.min_p, params.repetition_penalty) == (1.0, 1.0, 0.0, 1.0)


def cli_args(**flags: Any) -> argparse.Namespace:
    return argparse.Namespace(**({"max_tokens": None, "temperature": None, "top_p": None, "top_k": None} | flags))


def test_the_cli_takes_the_models_defaults_for_flags_left_out() -> None:
    params = _sampling_params(cli_args(top_p=0.5), {"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.5, 64)


def test_the_cli_stays_greedy_for_a_model_without_defaults() -> None:
    assert _sampling_params(cli_args(), {}).temperature == 0.0


# ---------------------------------------------------------------------- the embedded model's folder


def test_an_old_default_model_folder_gets_the_model_cards_sampling(tmp_path: Path) -> None:
    write_generation_config(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})  # as converted before
    _add_model_card_sampling(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.2, "top_p": 0.9}
    assert DEFAULT_MODEL_SAMPLING == {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card


def test_a_hand_edited_default_model_temperature_stays(tmp_path: Path) -> None:
    write_generation_config(tmp_path, {"eos_token_id": 2, "temperature": 0.0})
    _add_model_card_sampling(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert (config["temperature"], config["top_p"]) == (0.0, 0.9)
