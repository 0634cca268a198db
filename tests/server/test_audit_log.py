"""--audit-log: one JSON line per finished completion or chat request (streamed or not, errors
included), with a hash of the key and never the key itself; prompts and outputs only with
--audit-log-content."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, long_context_copy, run_server
from tokenmill.server.audit import AuditLog, key_id
from tokenmill.server.cli import server_config
from tokenmill.server.config import ServerConfig

KEY = "sk-audit-secret-123"
PROMPT = "The capital of France is"
CHAT_TEXT = "Hello world! How are you today?"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _lines(path: Path, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The file's lines once there are `count` of them (the writer thread appends them shortly after)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        lines = [json.loads(line) for line in text.splitlines()]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def _traffic(url_client: Any) -> None:
    with url_client as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        chat = {"messages": [{"role": "user", "content": CHAT_TEXT}], "max_tokens": 4, "ignore_eos": True}
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
            assert stream.status_code == 200
            assert "[DONE]" in stream.read().decode()
        bad = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 10_000})
        assert bad.status_code == 400


def _run(chat_model: Path, path: Path, content: bool) -> list[dict[str, Any]]:
    config = ServerConfig(api_keys=(KEY,), audit_log=str(path), audit_log_content=content)
    with run_server(chat_model, config) as server:
        _traffic(server.client(headers=AUTH))
        with server.client() as client:  # no key: a 401, written with key "-"
            assert client.post("/v1/completions", json={"prompt": PROMPT}).status_code == 401
        lines = _lines(path, 4)
        server.wait_idle()
    # Lines come in the order requests end: the stream's may come after the next request's.
    order = {("/v1/completions", 200): 0, ("/v1/chat/completions", 200): 1, ("/v1/completions", 400): 2}
    return sorted(lines, key=lambda line: order.get((line["route"], line["status"]), 3))


@pytest.fixture(scope="module")
def plain(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    return path, _run(chat_model, path, content=False)


def test_a_line_per_request_with_typed_fields(plain: tuple[Path, list[dict[str, Any]]]) -> None:
    _, lines = plain
    assert len(lines) == 4
    done, streamed, bad, unauthorized = lines
    for line in lines:
        assert set(line) == {
            "time",
            "key",
            "client",
            "method",
            "route",
            "model",
            "status",
            "prompt_tokens",
            "output_tokens",
            "latency_s",
            "finish_reason",
        }
        assert line["time"].endswith("+00:00")
        assert line["client"] == "127.0.0.1"
        assert isinstance(line["latency_s"], float) and line["latency_s"] >= 0
        assert isinstance(line["status"], int)
    assert done["route"] == "/v1/completions" and streamed["route"] == "/v1/chat/completions"
    assert [line["status"] for line in lines] == [200, 200, 400, 401]
    assert unauthorized["route"] == bad["route"] == "/v1/completions"
    assert done["key"] == streamed["key"] == bad["key"] == key_id(f"Bearer {KEY}")
    assert len(done["key"]) == 12 and unauthorized["key"] == "-"
    assert done["model"] == streamed["model"] == MODEL_NAME
    assert {line["method"] for line in lines} == {"POST"}
    assert isinstance(done["prompt_tokens"], int) and done["prompt_tokens"] > 0
    assert done["output_tokens"] == 3 and done["finish_reason"] == "length"
    assert isinstance(streamed["prompt_tokens"], int) and streamed["prompt_tokens"] > 0
    assert streamed["output_tokens"] == 4 and streamed["finish_reason"] == "length"
    assert bad["prompt_tokens"] is None and bad["output_tokens"] is None and bad["finish_reason"] is None


def test_no_prompt_and_no_key_in_the_file_by_default(plain: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = plain
    text = path.read_text()
    assert KEY not in text
    assert PROMPT not in text and CHAT_TEXT not in text


def test_content_adds_prompts_and_outputs(chat_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    done, streamed, bad, unauthorized = _run(chat_model, path, content=True)
    assert done["prompt"] == PROMPT
    assert isinstance(done["output"], list) and len(done["output"]) == 1 and isinstance(done["output"][0], str)
    assert streamed["prompt"] == [{"role": "user", "content": CHAT_TEXT}]
    assert isinstance(streamed["output"], list) and len(streamed["output"]) == 1
    assert bad["prompt"] == PROMPT and bad["output"] is None
    assert KEY not in path.read_text()


def test_an_aborted_request_is_written(chat_model: Path, tmp_path: Path) -> None:
    """A client that leaves before its (unstreamed) answer: status 499, finish_reason "abort"."""
    model = long_context_copy(chat_model, tmp_path / "model")
    path = tmp_path / "audit.jsonl"
    config = ServerConfig(audit_log=str(path))
    with run_server(model, config, max_model_len=4096, num_kv_blocks=512) as server:
        with httpx.Client(base_url=server.url, timeout=0.3) as client, pytest.raises(httpx.TimeoutException):
            client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True})
        lines = _lines(path, 1)
        server.wait_idle()
    assert len(lines) == 1
    (line,) = lines
    assert line["status"] == 499 and line["finish_reason"] == "abort" and line["key"] == "-"
    assert isinstance(line["output_tokens"], int) and line["output_tokens"] < 4000


def test_lines_are_appended_and_flushed_on_close(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"earlier": 1}\n')
    audit = AuditLog(str(path))
    for i in range(500):
        audit.write({"i": i})
    audit.close()
    audit.write({"i": 500})  # after close: written directly, not lost
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"earlier": 1}
    assert [line["i"] for line in lines[1:]] == list(range(501))


def test_cli_flags() -> None:
    import argparse

    from tokenmill.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--audit-log", "a.jsonl", "--audit-log-content"])
    config = server_config(args)
    assert config.audit_log == "a.jsonl" and config.audit_log_content
    assert server_config(parser.parse_args(["serve"])).audit_log is None
