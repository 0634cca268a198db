"""The server applies the model's generation_config.json to the sampling fields a request leaves out;
`--generation-config vllm` ignores the file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.launcher import print_usage

PROMPT = [10, 11, 12, 13]
SEED = 1234


@pytest.fixture(scope="module")
def greedy_chat_model(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model whose generation_config.json asks for greedy decoding and 6 new tokens."""
    folder = tmp_path_factory.mktemp("greedy-chat") / "model"
    shutil.copytree(chat_model, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"temperature": 0.0, "max_new_tokens": 6}))
    return folder


@pytest.fixture(scope="module")
def server(greedy_chat_model: Path) -> Iterator[RunningServer]:
    with run_server(greedy_chat_model) as running:
        yield running


@pytest.fixture(scope="module")
def ignoring_server(greedy_chat_model: Path) -> Iterator[RunningServer]:
    with run_server(greedy_chat_model, generation_config="vllm") as running:
        yield running


def post(server: RunningServer, **fields: Any) -> dict[str, Any]:
    """The response to a /v1/completions request for PROMPT."""
    with server.client() as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **fields})
    assert response.status_code == 200, response.text
    return dict(response.json())


def completion(server: RunningServer, **fields: Any) -> str:
    return str(post(server, **fields)["choices"][0]["text"])


def test_a_request_without_temperature_is_greedy(server: RunningServer) -> None:
    assert completion(server, max_tokens=8, seed=SEED) == completion(server, max_tokens=8, temperature=0.0)


def test_an_explicit_temperature_is_honoured(server: RunningServer) -> None:
    sampled = completion(server, max_tokens=8, temperature=1.0, seed=SEED)
    assert sampled != completion(server, max_tokens=8, temperature=0.0)  # 8 near-uniform draws over 512 tokens


def test_a_request_without_max_tokens_gets_the_models_max_new_tokens(server: RunningServer) -> None:
    assert post(server)["usage"]["completion_tokens"] == 6


def test_chat_without_temperature_is_greedy(server: RunningServer) -> None:
    def reply(**fields: Any) -> str:
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "ignore_eos": True, **fields}
        with server.client() as client:
            return str(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])

    assert reply(seed=SEED) == reply(temperature=0.0)


def test_generation_config_vllm_ignores_the_file(ignoring_server: RunningServer) -> None:
    default = completion(ignoring_server, max_tokens=8, seed=SEED)
    assert default == completion(ignoring_server, max_tokens=8, temperature=1.0, seed=SEED)  # OpenAI's default
    assert default != completion(ignoring_server, max_tokens=8, temperature=0.0)


def test_the_startup_message_names_the_defaults(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    print_usage(server.server)
    assert (
        "sampling defaults from the model's generation_config.json: temperature=0.0, max_tokens=6 "
        "(requests may override; --generation-config vllm to ignore)"
    ) in capsys.readouterr().out
