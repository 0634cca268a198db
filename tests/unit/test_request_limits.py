"""max_tokens and the prompt's length are resolved in one function (engine/request_limits.py), which
the offline API's InputProcessor and the server's preparation both call."""

from __future__ import annotations

import pytest

from tokenmill.engine import input_processor
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.request_limits import RequestCaps, RequestRejected, resolve_max_tokens
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.scheduler import AdmissionLimits

LIMITS = AdmissionLimits(max_model_len=32, block_size=4, num_blocks=64)
SERVER = RequestCaps(max_tokens=20, max_prompt_tokens=31)


def test_without_max_tokens_the_request_gets_the_room_the_prompt_leaves() -> None:
    assert resolve_max_tokens(LIMITS, 10, None) == 22
    assert resolve_max_tokens(LIMITS, 31, None) == 1


def test_without_max_tokens_a_caps_default_and_cap_come_first() -> None:
    assert resolve_max_tokens(LIMITS, 10, None, RequestCaps(default_max_tokens=16)) == 16
    assert resolve_max_tokens(LIMITS, 10, None, SERVER) == 20  # the cap, under the room of 22
    assert resolve_max_tokens(LIMITS, 28, None, SERVER) == 4  # the room, under the cap


def test_a_prompt_over_the_callers_cap_is_refused_with_its_code() -> None:
    caps = RequestCaps(max_prompt_tokens=8)
    with pytest.raises(RequestRejected, match="the prompt has 9 tokens; this server accepts at most 8") as info:
        resolve_max_tokens(LIMITS, 9, 4, caps)
    assert (info.value.code, info.value.param) == ("prompt_too_long", "prompt")


def test_max_tokens_over_the_callers_cap_is_refused_with_its_code() -> None:
    with pytest.raises(RequestRejected, match="max_tokens is 21; this server allows at most 20") as info:
        resolve_max_tokens(LIMITS, 4, 21, SERVER)
    assert (info.value.code, info.value.param) == ("max_tokens_too_large", "max_tokens")


def test_without_caps_only_the_engines_limits_hold() -> None:
    assert resolve_max_tokens(LIMITS, 4, 28) == 28
    with pytest.raises(RequestRejected, match=r"= 33 exceeds max_model_len \(32\)") as info:
        resolve_max_tokens(LIMITS, 4, 29)
    assert isinstance(info.value, ValueError) and info.value.code == "invalid_request"


def test_the_input_processor_resolves_max_tokens_through_the_one_function(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int | None, RequestCaps]] = []

    def counting(limits: AdmissionLimits, num_prompt_tokens: int, requested: int | None, caps: RequestCaps) -> int:
        calls.append((num_prompt_tokens, requested, caps))
        return resolve_max_tokens(limits, num_prompt_tokens, requested, caps)

    monkeypatch.setattr(input_processor, "resolve_max_tokens", counting)
    inputs = InputProcessor(None, 100, [2], LIMITS)
    prepared = inputs.process("r", [5, 6, 7], SamplingParams(max_tokens=None, min_tokens=40), caps=SERVER)
    assert calls == [(3, None, SERVER)]
    # The resolved max_tokens is the request's; min_tokens never exceeds it.
    assert (prepared.params.max_tokens, prepared.params.min_tokens) == (20, 20)
    assert all(c.max_tokens == 20 for c in prepared.children)


def test_a_prompt_that_leaves_no_room_is_a_value_error_offline() -> None:
    inputs = InputProcessor(None, 100, [2], LIMITS)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        inputs.process("r", list(range(3, 35)), SamplingParams(max_tokens=None))
