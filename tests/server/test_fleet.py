"""Two replicas on a local Ray Serve instance, through the fleet's ingress and prefix-aware router: the
official `openai` client (streamed and not), API keys (checked before the body is read, throttled),
per-replica metrics, admin calls reaching every replica, and shared-prefix requests landing on the
replica that holds their prefix."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, engine_args, free_port, reseeded_copy

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tokenmill[ray]')")

from tokenmill.fleet.config import FleetConfig  # noqa: E402
from tokenmill.fleet.launcher import FleetRun  # noqa: E402
from tokenmill.server.config import PoolConfig, ServerConfig  # noqa: E402

KEY = "sk-fleet-test"
ADMIN = "sk-fleet-admin"
SHARED = "The capital of France is Paris. The quick brown fox jumps over the lazy dog. " * 3  # ~3 blocks


@pytest.fixture(scope="module")
def fleet(
    chat_model: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[str]:
    monkeypatch_module.delenv("RAY_ADDRESS", raising=False)
    other = reseeded_copy(chat_model, tmp_path_factory.mktemp("other") / "model", seed=1)
    pool = PoolConfig(extra_models=(("other", str(other)),), admin_key=ADMIN)  # every replica serves it too
    config = ServerConfig(port=free_port(), served_model_name=MODEL_NAME, api_keys=(KEY,), models=pool)
    fleet = FleetConfig(num_replicas=2, routing_stats_period_s=0.5)
    run = FleetRun(engine_args(chat_model), config, fleet, log_to_driver=False)
    try:
        yield run.url
    finally:
        run.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def client(fleet: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text


def metrics_after(url: str, before: str, name: str, grown_by: float, timeout_s: float = 20) -> str:
    """The fleet's metrics once the replicas' counter `name` has grown by `grown_by` since `before`."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(url)
        if sample(text, name) - sample(before, name) >= grown_by or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_completion_and_chat_through_the_fleet(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "other"]


def test_streamed_chat_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    whole = client.chat.completions.create(temperature=0.0, extra_body={"ignore_eos": True}, **kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(stream=True, temperature=0.0, extra_body={"ignore_eos": True}, **kwargs)  # type: ignore[call-overload]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    # Deltas that queue while the client reads are merged into one chunk (AsyncEngine._outputs), so how
    # many chunks carry the six tokens depends on timing; the stream still ends with its own reason.
    assert len(chunks) >= 2 and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_request_without_the_api_key_is_refused(fleet: str) -> None:
    response = httpx.post(f"{fleet}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"]
    assert httpx.get(f"{fleet}/metrics", timeout=30).status_code == 401


def test_shared_prefix_requests_land_on_the_replica_that_holds_the_prefix(client: openai.OpenAI, fleet: str) -> None:
    before = metrics(fleet)
    tenants = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
    for i in range(5):
        for tenant in tenants:  # a cache_salt per tenant: four prefixes the router must keep apart
            client.completions.create(
                model=MODEL_NAME, prompt=f"{SHARED} question {i}", max_tokens=2, extra_body={"cache_salt": tenant}
            )
    # Replicas report their metrics every 0.5 s here: wait until the report covers these requests.
    after = metrics_after(fleet, before, "tokenmill:request_success_total", 5 * len(tenants))
    hits = sample(after, "tokenmill:router_decisions_total", decision="affinity") - sample(
        before, "tokenmill:router_decisions_total", decision="affinity"
    )
    hit_rate = hits / (5 * len(tenants))
    print(f"router affinity hit rate on shared prefixes: {hit_rate:.2f}")
    assert hit_rate >= 0.8 - 1e-9  # every request after each tenant's first
    # The replicas' own prefix caches saw the hits the router aimed for.
    cached = sample(after, "tokenmill:prefix_cache_hits_total") - sample(before, "tokenmill:prefix_cache_hits_total")
    assert cached > 0


def test_metrics_show_each_replica_and_the_fleet_size(fleet: str) -> None:
    # The ingress reads the replica count every 2 s and the replicas report every 0.5 s: poll.
    deadline = time.monotonic() + 20
    while True:
        text = metrics(fleet)
        replicas = set(re.findall(r'tokenmill:prompt_tokens_total\{replica="([^"]+)"', text))
        counts = {s: sample(text, "tokenmill:fleet_replicas", state=s) for s in ("current", "target", "min", "max")}
        if (len(replicas), set(counts.values())) == (2, {2}) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2
    assert counts == {"current": 2, "target": 2, "min": 2, "max": 2}


def test_the_app_builder_takes_tokenmill_serve_flags(chat_model: Path) -> None:
    from tokenmill.fleet.app import build_app

    assert type(build_app({"args": f"--replicas 2 --max-model-len 256 {chat_model}"})).__name__ == "Application"
    with pytest.raises(ValueError, match="args="):
        build_app({"model": str(chat_model)})


def test_the_replicas_serve_the_extra_model_by_name(client: openai.OpenAI) -> None:
    client = client.with_options(timeout=180)  # the first request waits for the model's engine to start
    default = client.completions.create(model=MODEL_NAME, prompt="The capital", max_tokens=8, temperature=0)
    other = client.completions.create(model="other", prompt="The capital", max_tokens=8, temperature=0)
    again = client.completions.create(model="other", prompt="The capital", max_tokens=8, temperature=0)
    assert other.model == "other" and default.model == MODEL_NAME
    assert other.choices[0].text == again.choices[0].text != default.choices[0].text  # its own weights


def test_a_request_without_a_key_is_refused_before_its_body_arrives(fleet: str) -> None:
    host, port = httpx.URL(fleet).host, httpx.URL(fleet).port
    with socket.create_connection((host, port), timeout=20) as conn:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000000\r\n\r\n"
        conn.sendall(head.encode() + b'{"prompt": "')  # and nothing more: the ingress must not wait for it
        assert conn.recv(4096).startswith(b"HTTP/1.1 401 ")


def test_json_nested_beyond_the_parsers_depth_gets_the_servers_answer(fleet: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{fleet}/v1/completions", content=b"[" * 100_000, headers=headers, timeout=30)
    assert 400 <= response.status_code < 500 and response.json()["error"]


def test_an_admin_call_reaches_every_replica(fleet: str) -> None:
    listed = httpx.get(f"{fleet}/admin/models", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert listed.status_code == 200, listed.text
    replicas = listed.json()["replicas"]
    assert len({r["replica"] for r in replicas}) == 2
    assert all(r["status"] == 200 and MODEL_NAME in [m["id"] for m in r["body"]["data"]] for r in replicas)
    assert httpx.get(f"{fleet}/admin/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 401


def test_failed_keys_on_the_fleets_metrics_are_throttled(fleet: str) -> None:
    # Last in this module: it locks 127.0.0.1 out (the key that logged in from there still works).
    statuses = [httpx.get(f"{fleet}/metrics", headers={"Authorization": "Bearer guess"}).status_code for _ in range(11)]
    assert set(statuses) <= {401, 429} and statuses[-1] == 429
    assert httpx.get(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
