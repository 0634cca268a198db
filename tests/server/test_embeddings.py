"""POST /v1/embeddings, /v1/score and /v1/rerank through the official openai SDK (and httpx where it has
no method), on the tiny random chat model: the model is random, so similarity is checked only where it is
certain (a text against itself scores 1.0)."""

from __future__ import annotations

import base64
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tests.tiny_models import TINY
from tokenmill.server.config import PoolConfig, ServerConfig

HIDDEN = TINY["hidden_size"]
TEXTS = ["The capital of France is Paris.", "def main():\n    return 42", "Hello world!"]


@pytest.fixture(scope="module")
def scorer(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForSequenceClassification (one label) with the chat model's tokenizer."""
    folder = tmp_path_factory.mktemp("scorer")
    config = AutoConfig.for_model("llama", **(TINY | dict(num_labels=1)))
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (chat_model / name).exists():
            shutil.copy(chat_model / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def server(chat_model: Path, scorer: Path) -> Iterator[RunningServer]:
    """The chat model, and the classifier as the extra model "scorer" (loaded when first named)."""
    pool = PoolConfig(extra_models=(("scorer", str(scorer)),))
    with run_server(chat_model, ServerConfig(engine_in_thread=True, models=pool)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def norm(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def test_float_and_base64_embeddings_are_equal(client: openai.OpenAI, server: RunningServer) -> None:
    as_float = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.object == "list"
    for a, b in zip(as_float.data, decoded.data):
        assert a.object == "embedding" and len(a.embedding) == HIDDEN
        assert b.embedding == pytest.approx(a.embedding, abs=1e-6)
        assert norm(a.embedding) == pytest.approx(1.0, abs=1e-5)
    raw = server.client().post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    values = struct.unpack(f"<{HIDDEN}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(values) == pytest.approx(as_float.data[0].embedding, abs=1e-6)
    tokens = sum(len(server.engine.tokenizer.encode(t)) for t in TEXTS)  # type: ignore[union-attr]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens
    server.wait_idle()  # every block free: pooling requests keep no KV


def test_token_id_inputs_embed_as_their_text(client: openai.OpenAI, server: RunningServer) -> None:
    ids = server.engine.tokenizer.encode(TEXTS[1])  # type: ignore[union-attr]
    by_text = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[ids, ids[:3]], encoding_format="float")
    assert len(by_ids.data) == 2
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[0].embedding, abs=1e-6)
    assert by_ids.data[1].embedding != pytest.approx(by_text.data[0].embedding, abs=1e-3)


def test_dimensions_truncate_then_renormalize(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float", dimensions=16)
    head = full[:16]
    assert short.data[0].embedding == pytest.approx([v / norm(head) for v in head], abs=1e-5)


def test_a_text_scores_one_against_itself_and_beats_an_unrelated_one(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "text_1": TEXTS[0], "text_2": [TEXTS[0], "12345 + 678 = 13023"]}
    reply = server.client().post("/v1/score", json=body).json()
    assert reply["object"] == "list" and reply["method"] == "cosine"
    first, second = (d["score"] for d in reply["data"])
    assert first == pytest.approx(1.0, abs=1e-5) and first > second
    assert [d["index"] for d in reply["data"]] == [0, 1] and reply["usage"]["prompt_tokens"] > 0


def test_rerank_ranks_and_cuts_to_top_n(server: RunningServer) -> None:
    documents = ["12345 + 678 = 13023", {"text": TEXTS[0]}, "alice@example.com"]
    body = {"query": TEXTS[0], "documents": documents, "top_n": 2}
    reply = server.client().post("/v1/rerank", json=body).json()
    assert reply["method"] == "cosine" and reply["model"] == MODEL_NAME and reply["usage"]["total_tokens"] > 0
    results = reply["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert results[0]["document"] == {"text": TEXTS[0]}
    bare = server.client().post("/v1/rerank", json=body | {"return_documents": False}).json()
    assert all("document" not in r for r in bare["results"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(input=TEXTS[0], dimensions=HIDDEN + 1),  # more than the model has
        dict(input=[]),  # nothing to embed
        dict(input=[[1, 2, TINY["vocab_size"]]]),  # a token id outside the vocabulary
        dict(input=TEXTS[0], encoding_format="int8"),
    ],
)
def test_bad_input_is_a_bad_request(client: openai.OpenAI, kwargs: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL_NAME, **kwargs)


def test_bad_score_and_rerank_bodies_are_400s(server: RunningServer) -> None:
    http = server.client()
    assert http.post("/v1/rerank", json={"query": "q", "documents": []}).status_code == 400
    assert http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}).status_code == 400
    reply = http.post("/v1/rerank", json={"query": "q", "documents": ["d"], "model": "other"})
    assert reply.status_code == 404 and reply.json()["error"]["message"]


@torch.inference_mode()
def test_rerank_with_a_classification_head_is_its_logit_on_the_pair(server: RunningServer, scorer: Path) -> None:
    query, documents = TEXTS[0], TEXTS[1:]
    reply = server.client().post("/v1/rerank", json={"model": "scorer", "query": query, "documents": documents})
    assert reply.status_code == 200, reply.text
    tokenizer = AutoTokenizer.from_pretrained(scorer)
    hf = AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32).eval()
    expected = [float(hf(torch.tensor([tokenizer(query, d)["input_ids"]])).logits[0, 0]) for d in documents]
    body = reply.json()
    assert body["method"] == "classification" and body["model"] == "scorer"
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == pytest.approx(dict(enumerate(expected)))
    assert [r["index"] for r in body["results"]] == sorted(range(2), key=lambda i: -expected[i])
    embed = server.client().post("/v1/embeddings", json={"model": "scorer", "input": "hi"})
    assert embed.status_code == 400 and "classifier" in embed.json()["error"]["message"]
