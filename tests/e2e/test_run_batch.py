"""`tokenmill run-batch`: a Batch API file run offline through the CLI's main function, one output line
per request in OpenAI's format, the same bodies as the offline LLM's greedy outputs, errors per line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.conftest import make_chat_model
from tokenmill import LLM
from tokenmill.cli import main
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["Hello world", "The capital of France", "def main"]
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64"]  # a small, quick engine


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def test_run_batch_writes_each_requests_output(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {"model": "any", "max_tokens": 5, "temperature": 0}
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": p}}
        for i, p in enumerate(PROMPTS)
    ]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**body, "n": 0}})
    lines.append(
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "messages": [{"role": "user", "content": "Hi"}]},
        }
    )
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    main(["run-batch", "-i", str(source), "-o", str(output), "--model", str(chat_model), *ENGINE_FLAGS])
    assert "4 of 5 requests succeeded, 1 failed" in capsys.readouterr().out

    results = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(results) == ["bad", "c0", "c1", "c2", "chat"]
    assert results["bad"]["response"]["status_code"] == 400
    assert results["bad"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert results["chat"]["response"]["body"]["object"] == "chat.completion"
    llm = LLM(str(chat_model), dtype="float32", max_model_len=128, num_kv_blocks=64)
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    for i, out in enumerate(expected):
        response = results[f"c{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["text"] == out.outputs[0].text


def test_run_batch_refuses_a_bad_file_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n')
    with pytest.raises(SystemExit):
        main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl")])
    assert 'line 1: method must be "POST"' in capsys.readouterr().err
