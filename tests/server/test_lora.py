"""LoRA adapters over HTTP: `--lora-modules` at start, `model` naming an adapter (greedy text equal to HF +
PEFT with it merged, the base and the adapter in one batch), /v1/models with `parent`, runtime loads and
unloads (an unload waits for the adapter's requests in flight), clear errors, and the admin key."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_lora_adapter import make_adapter
from tests.server.conftest import MODEL_NAME, run_server
from tests.tiny_models import hf_greedy, hf_model
from tokenmill.server.config import ServerConfig

PROMPT = [5, 17, 33, 64, 101, 7, 250, 9]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("server-loras")
    one, model_one = make_adapter(chat_model, root / "one", seed=1)
    two, model_two = make_adapter(chat_model, root / "two", seed=2, r=8, target_modules=["q_proj", "down_proj"])
    tokenizer = hf_model(chat_model)  # only for the base's greedy tokens
    greedy = {
        "base": hf_greedy(tokenizer, PROMPT, MAX_TOKENS),
        "one": hf_greedy(model_one.merge_and_unload(), PROMPT, MAX_TOKENS),
        "two": hf_greedy(model_two.merge_and_unload(), PROMPT, MAX_TOKENS),
    }
    assert greedy["one"] != greedy["base"] and greedy["two"] != greedy["base"]  # each adapter matters
    return {"one": one, "two": two, "greedy": greedy}


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return client.post("/v1/completions", json=body)


def _text(server: Any, tokens: list[int]) -> str:
    return str(server.engine.tokenizer.decode(tokens, skip_special_tokens=True))


def test_adapters_by_model_name_match_peft_merged(chat_model: Path, adapters: dict[str, Any]) -> None:
    config = ServerConfig(lora_modules=(f"one={adapters['one']}",))
    with run_server(chat_model, config, enable_lora=True, max_lora_rank=8) as server, server.client() as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [(MODEL_NAME, None), ("one", MODEL_NAME)]
        # The base and the adapter at once: they share steps.
        replies: dict[str, httpx.Response] = {}
        threads = [
            threading.Thread(target=lambda m=m: replies.__setitem__(m, _complete(server.client(), m)))
            for m in (MODEL_NAME, "one")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert replies["one"].json()["model"] == "one"
        assert replies["one"].json()["choices"][0]["text"] == _text(server, adapters["greedy"]["one"])
        assert replies[MODEL_NAME].json()["choices"][0]["text"] == _text(server, adapters["greedy"]["base"])
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200 and chat.json()["model"] == "one"

        # Runtime load, then the adapter serves; a bad one is a 400 that says why.
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(adapters["two"])})
        assert loaded.status_code == 200, loaded.text
        assert _complete(client, "two").json()["choices"][0]["text"] == _text(server, adapters["greedy"]["two"])
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(adapters["two"])})
        assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
        missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"})
        assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]

        # An unload waits for the adapter's request in flight, which finishes whole.
        long_body = {"model": "two", "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True}
        result: dict[str, httpx.Response] = {}
        worker = threading.Thread(
            target=lambda: result.__setitem__("r", server.client().post("/v1/completions", json=long_body))
        )
        worker.start()
        while not server.engine.streams:
            pass
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
        worker.join()
        assert unloaded.status_code == 200 and unloaded.json()["aborted_requests"] == 0
        assert result["r"].json()["usage"]["completion_tokens"] == 120
        gone = _complete(client, "two")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "two"}).status_code == 404
        embed = client.post("/v1/embeddings", json={"model": "one", "input": "hi"})
        assert embed.status_code == 400


def test_with_an_admin_key_only_it_loads_adapters(chat_model: Path, adapters: dict[str, Any], monkeypatch: Any) -> None:
    monkeypatch.setenv("TOKENMILL_ADMIN_KEY", "admin-secret")
    with run_server(chat_model, ServerConfig(), enable_lora=True, max_lora_rank=8) as server, server.client() as client:
        body = {"lora_name": "one", "lora_path": str(adapters["one"])}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401
        headers = {"Authorization": "Bearer admin-secret"}
        assert client.post("/v1/load_lora_adapter", json=body, headers=headers).status_code == 200
        assert _complete(client, "one").json()["choices"][0]["text"] == _text(server, adapters["greedy"]["one"])


def test_adapters_from_the_model_registry(
    chat_model: Path, adapters: dict[str, Any], tmp_path: Path, monkeypatch: Any
) -> None:
    """`--lora-modules NAME=ID` and a runtime load's `lora_path` name an adapter version in the registry
    (an alias, a bare name: its highest version); an id the registry lacks, or a model's, is a 400."""
    from tokenmill.registry import Registry

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))  # the default registry lives there
    registry = Registry()
    registry.add("sql", adapters["one"], alias="sql-stable")  # sql@1
    registry.add("sql", adapters["two"])  # sql@2
    registry.add("base", chat_model)
    config = ServerConfig(lora_modules=("stable=sql-stable",))
    with run_server(chat_model, config, enable_lora=True, max_lora_rank=8) as server, server.client() as client:
        assert _complete(client, "stable").json()["choices"][0]["text"] == _text(server, adapters["greedy"]["one"])
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "latest", "lora_path": "sql"})
        assert loaded.status_code == 200, loaded.text
        assert _complete(client, "latest").json()["choices"][0]["text"] == _text(server, adapters["greedy"]["two"])
        for path, message in (("nothing", "neither a LoRA adapter folder nor"), ("base", "a model, not a LoRA")):
            bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert bad.status_code == 400 and message in bad.json()["error"]["message"]
