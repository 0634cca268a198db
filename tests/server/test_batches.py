"""The Batch API through the openai SDK: files up and down, batches run to completed with the online
route's bodies, per-key visibility, bad input files, cancel, and a restart mid-batch that resumes."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.config import ServerConfig

KEYS = ("key-alpha", "key-beta")


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, text: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}


def slow_lines(count: int) -> list[dict[str, Any]]:
    """Lines that each run 64 decode steps, so that a test can act while the batch runs."""
    return [chat_line(f"slow-{i}", f"tell me {i}", max_tokens=64, ignore_eos=True) for i in range(count)]


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.05)


def start_batch(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> Any:
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def completed(batch: Any) -> int:
    assert batch.request_counts is not None
    return int(batch.request_counts.completed)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # One line at a time, as the online requests it is compared with run: the same batch shapes.
    files = str(tmp_path_factory.mktemp("files"))
    config = ServerConfig(api_keys=KEYS, files_dir=files, max_file_bytes=20_000, batch_max_in_flight=1)
    with run_server(chat_model, config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def other(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0)


def test_files_upload_list_content_delete(client: openai.OpenAI) -> None:
    data = jsonl([chat_line("a", "hi")])
    upload = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert (upload.bytes, upload.filename, upload.purpose) == (len(data), "mine.jsonl", "batch")
    assert client.files.retrieve(upload.id).id == upload.id
    assert upload.id in [f.id for f in client.files.list()]
    assert client.files.content(upload.id).content == data
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_upload_refuses_other_purposes_and_files_over_the_cap(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", b"x" * 20_001), purpose="batch")
    assert exc.value.status_code == 413


def test_batch_completes_with_the_online_routes_bodies(client: openai.OpenAI) -> None:
    lines = [chat_line(f"chat-{i}", text) for i, text in enumerate(["Hello", "The capital of France", "def main"])]
    batch = start_batch(client, lines)
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 3
    done = wait_for(client, batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert done.error_file_id is None and done.completed_at is not None
    results = {line["custom_id"]: line for line in output_lines(client, done.output_file_id)}
    assert sorted(results) == ["chat-0", "chat-1", "chat-2"]
    for line in lines:
        online = client.chat.completions.with_raw_response.create(**line["body"]).http_response.json()
        response = results[line["custom_id"]]["response"]
        assert response["status_code"] == 200
        for field in ("id", "created"):  # differ between any two requests
            del online[field], response["body"][field]
        # The online repeat finds the line's prompt in the prefix cache.
        assert online["usage"].pop("prompt_tokens_details")["cached_tokens"] > 0
        response["body"]["usage"].pop("prompt_tokens_details")
        assert response["body"] == online


def test_failed_lines_go_to_the_error_file(client: openai.OpenAI) -> None:
    good = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**good, "max_tokens": -1}},
    ]
    done = wait_for(client, start_batch(client, lines, "/v1/completions").id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [ok] = output_lines(client, done.output_file_id)
    [bad] = output_lines(client, done.error_file_id)
    assert ok["custom_id"] == "ok" and ok["response"]["body"]["object"] == "text_completion"
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert "max_tokens" in bad["response"]["body"]["error"]["message"]


def test_an_embeddings_batch_answers_as_the_route(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "input": ["Hello world", "The fox"], "encoding_format": "float"}
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": body}
    done = wait_for(client, start_batch(client, [line], "/v1/embeddings").id, ("completed",))
    [result] = output_lines(client, done.output_file_id)
    online = client.embeddings.with_raw_response.create(**body).http_response.json()
    assert result["response"]["body"]["data"] == online["data"]


def test_another_key_sees_nothing(client: openai.OpenAI, other: openai.OpenAI) -> None:
    batch = start_batch(client, [chat_line("a", "hi")])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.id in [b.id for b in client.batches.list()]
    wait_for(client, batch.id, ("completed",))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([chat_line("same", "a"), chat_line("same", "b")], "custom_id 'same' is used twice"),
        ([{**chat_line("a", "a"), "url": "/v1/images"}], "url must be one of"),
        ([{**chat_line("a", "a"), "method": "GET"}], 'method must be "POST"'),
        ([{"custom_id": "a"}, "not json"], "line 1"),
    ],
)
def test_bad_batch_files_are_refused(client: openai.OpenAI, lines: list[Any], message: str) -> None:
    data = b"".join((json.dumps(x) if isinstance(x, dict) else x).encode() + b"\n" for x in lines)
    upload = client.files.create(file=("bad.jsonl", data), purpose="batch")
    with pytest.raises(openai.BadRequestError, match=message):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_cancel_stops_a_running_batch(client: openai.OpenAI, server: RunningServer) -> None:
    batch = start_batch(client, slow_lines(40))
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert completed(cancelled) < 40
    server.wait_idle()  # the lines in flight were aborted
    assert client.batches.retrieve(batch.id).status == "cancelled"


def test_a_restarted_server_resumes_the_batch(chat_model: Path, tmp_path: Path) -> None:
    # A drain too short for the line in flight: the server aborts it, and it must run again, not count.
    config = ServerConfig(files_dir=str(tmp_path), batch_max_in_flight=1, shutdown_timeout_s=0.01)
    lines = slow_lines(12)
    with run_server(chat_model, config) as first:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0)
        batch = start_batch(client, lines)
        while completed(client.batches.retrieve(batch.id)) < 2:
            time.sleep(0.02)
        first.server.handle_exit(signal.SIGTERM, None)  # as `tokenmill serve` stops: drain, abort, exit
        first.thread.join(15)
    stopped = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())["batch"]
    assert stopped["status"] == "in_progress" and 2 <= stopped["request_counts"]["completed"] < len(lines)
    with run_server(chat_model, config) as second:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
        done = wait_for(client, batch.id, ("completed",))
        results = output_lines(client, done.output_file_id)
    ids = [line["custom_id"] for line in results]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert {r["response"]["body"]["choices"][0]["finish_reason"] for r in results} == {"length"}
    assert completed(done) == len(lines)
