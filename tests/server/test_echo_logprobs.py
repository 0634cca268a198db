"""Echo with logprobs: every choice of n gets the prompt's logprobs, computed once for them all, and
--max-prompt-logprobs-entries caps (logprobs + 1) x prompt tokens (summed over the prompts, not x n)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.cli import add_serve_parser, server_config
from tokenmill.server.config import ServerConfig

PROMPT = [(7 * i) % 400 + 50 for i in range(40)]  # token ids: 40 tokens, two full blocks of 16 then 8
CAP = 3 * len(PROMPT)  # exactly logprobs=2 for one prompt


@pytest.fixture(scope="module")
def capped(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, ServerConfig(max_prompt_logprobs_entries=CAP)) as server:
        yield server


def _echo(prompt: Any, logprobs: int, n: int = 1) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "echo": True, "logprobs": logprobs, "n": n, "max_tokens": 3}


def _prompt_part(choice: dict[str, Any]) -> tuple[list[Any], ...]:
    lps = choice["logprobs"]
    return tuple(lps[key][: len(PROMPT)] for key in ("tokens", "token_logprobs", "top_logprobs"))


def test_every_choice_of_n_gets_the_prompt_logprobs_computed_once(capped: RunningServer) -> None:
    with capped.client() as client:
        one = client.post("/v1/completions", json=_echo(PROMPT, 2))
        assert one.status_code == 200, one.text
        hits = capped.core.kv_cache.stats.hits
        two = client.post("/v1/completions", json={**_echo(PROMPT, 2, n=2), "temperature": 1.0, "seed": 5})
        assert two.status_code == 200, two.text
    # The second sample starts from the first's two cached blocks (the n = 1 request's are cached too, but
    # the first sample of two, computing prompt logprobs, cannot use them).
    assert capped.core.kv_cache.stats.hits - hits == 32
    reference = _prompt_part(one.json()["choices"][0])
    tokens, token_logprobs, top_logprobs = reference
    assert len(tokens) == len(PROMPT) and token_logprobs[0] is None and top_logprobs[0] is None
    assert all(top for top in top_logprobs[1:])
    choices = two.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        got = _prompt_part(choice)
        assert got[0] == tokens and got[1][0] is None and got[2][0] is None
        assert got[1][1:] == pytest.approx(token_logprobs[1:], abs=1e-4)
        assert [t.keys() for t in got[2][1:]] == [t.keys() for t in top_logprobs[1:]]
    capped.wait_idle()


def test_prompt_logprobs_over_the_cap_get_400_and_n_does_not_count(capped: RunningServer) -> None:
    with capped.client() as client:
        r = client.post("/v1/completions", json=_echo(PROMPT, 3))  # 4 x 40 = 160 > 120
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "prompt_logprobs_too_large" and error["param"] == "logprobs"
        assert "160" in error["message"] and str(CAP) in error["message"]
        r = client.post("/v1/completions", json=_echo([PROMPT, PROMPT[:1]], 2))  # the prompts add up: 123
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_logprobs_too_large"
        assert client.post("/v1/completions", json=_echo(PROMPT, 2, n=3)).status_code == 200  # 120, at the cap
        no_echo = {**_echo(PROMPT, 5), "echo": False}  # no prompt logprobs at all
        assert client.post("/v1/completions", json=no_echo).status_code == 200
    capped.wait_idle()


def test_the_flag_parses_into_the_server_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert server_config(parser.parse_args(["serve"])).max_prompt_logprobs_entries == 1 << 20
    args = parser.parse_args(["serve", "--max-prompt-logprobs-entries", "7"])
    assert server_config(args).max_prompt_logprobs_entries == 7
    with pytest.raises(SystemExit):
        server_config(parser.parse_args(["serve", "--max-prompt-logprobs-entries", "-1"]))


def test_a_streamed_echo_of_a_prompt_prefilled_in_chunks_carries_all_its_logprobs(chat_model: Path) -> None:
    # 40 prompt tokens, 16 per step: the prompt's logprobs come from the engine in three chunks.
    with run_server(chat_model, max_num_batched_tokens=16) as server:
        with server.client() as client:
            whole = client.post("/v1/completions", json=_echo(PROMPT, 1)).json()["choices"][0]["logprobs"]
            with client.stream("POST", "/v1/completions", json={**_echo(PROMPT, 1), "stream": True}) as r:
                frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = frames[0]["choices"][0]["logprobs"]
    assert first["tokens"][: len(PROMPT)] == whole["tokens"][: len(PROMPT)]
    assert first["token_logprobs"][1 : len(PROMPT)] == pytest.approx(whole["token_logprobs"][1 : len(PROMPT)], abs=1e-4)
