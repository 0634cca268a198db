"""/dashboard and /dashboard/data: the same numbers as /metrics, errors counted by type without request
contents, the KV block breakdown, and the API key in front of both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig
from tokenmill.server.dashboard.samples import sample_key

SETTINGS = ServerConfig(slo_ttft_ms=250, slo_itl_ms=50, cost_per_hour=2.0)
SECRET = "a prompt nobody may see on the dashboard"


@pytest.fixture(scope="module")
def dash_server(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, SETTINGS, engine_process=True) as running:
        yield running


def metrics_text_samples(server: RunningServer) -> dict[str, float]:
    with server.client() as client:
        text = client.get("/metrics").text
    return {
        sample_key(s.name, dict(s.labels)): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def wait_for_points(server: RunningServer, count: int) -> dict:
    deadline = time.monotonic() + 10
    with server.client() as client:
        while True:
            data = client.get("/dashboard/data").json()
            if len(data["points"]) >= count or time.monotonic() > deadline:
                return data
            time.sleep(0.2)


def test_page_and_assets_are_served_without_a_cdn(dash_server: RunningServer) -> None:
    with dash_server.client() as client:
        page = client.get("/dashboard")
        script = client.get("/dashboard/static/dashboard.js")
        assert client.get("/dashboard/static/../../app.py").status_code == 404
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert page.text.count('class="panel"') == 10
    assert "http://" not in page.text and "https://" not in page.text
    assert script.status_code == 200 and "https://" not in script.text


def test_data_gives_the_same_numbers_as_metrics(dash_server: RunningServer) -> None:
    with dash_server.client() as client:
        for _ in range(3):
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200
    dash_server.wait_idle()
    time.sleep(1.2)  # a sample after the last step (the process gauges move every second)
    with dash_server.client() as client:
        data = client.get("/dashboard/data").json()
    text = metrics_text_samples(dash_server)
    sampled = ("cpu_busy_cores", "resident_memory", "throughput", "cost_per_million", "gpu_")  # move on their own
    stable = [k for k in text if not any(s in k for s in sampled)]
    assert stable and {k: data["metrics"][k] for k in stable} == {k: text[k] for k in stable}
    assert data["metrics"]['tokenmill:generation_tokens_total{model_name="tiny-chat"}'] >= 18
    route = 'tokenmill:route_tokens_total{model_name="tiny-chat",phase="decode",route="/v1/completions"}'
    assert data["metrics"][route] >= 18
    assert (
        sum(n for _, n in data["distributions"]["batch_size"])
        == text['tokenmill:batch_size_count{model_name="tiny-chat"}']
    )
    assert data["settings"]["slo_ttft_s"] == 0.25 and data["settings"]["cost_per_hour"] == 2.0


def test_points_carry_every_panel_figure(dash_server: RunningServer) -> None:
    data = wait_for_points(dash_server, 2)
    point = data["points"][-1]
    for key in (
        "tokens_per_s",
        "prefill_tps",
        "decode_tps",
        "routes_tps",
        "batch_size_mean",
        "kv_blocks",
        "rss_bytes",
        "ttft_p99",
        "itl_p99",
        "e2e_p99",
        "waiting",
        "cpu_busy_cores",
        "errors_per_s",
        "replicas",
        "cost_per_million",
        "utilization",
        "baseline",
    ):
        assert key in point, key
    assert point["replicas"] == {"current": 1.0, "target": 1.0, "min": 1.0, "max": 1.0}  # not on Ray
    assert set(point["rss_bytes"]) == {"server", "engine"} and point["rss_bytes"]["engine"] > 10 << 20
    blocks = point["kv_blocks"]
    assert blocks["used"] + blocks["cached"] + blocks["free"] == dash_server.engine.num_blocks
    with dash_server.client() as client:
        newer = client.get("/dashboard/data", params={"since": point["t"]}).json()["points"]
    assert all(p["t"] > point["t"] for p in newer)


def test_freed_prompt_blocks_count_as_cached_not_free(dash_server: RunningServer) -> None:
    prompt = list(range(10, 10 + 64))  # 4 full blocks of 16, kept by the prefix cache once freed
    with dash_server.client() as client:
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    dash_server.wait_idle()
    text = metrics_text_samples(dash_server)
    assert text['tokenmill:kv_cache_blocks{model_name="tiny-chat",state="cached"}'] >= 4
    assert text['tokenmill:kv_cache_blocks{model_name="tiny-chat",state="used"}'] == 0


def test_errors_are_counted_by_type_without_request_contents(dash_server: RunningServer) -> None:
    with dash_server.client() as client:
        before = client.get("/dashboard/data").json()["errors"]["totals"]
        bad = client.post("/v1/completions", json={"prompt": SECRET, "max_tokens": -1})
        assert bad.status_code == 400
        assert client.post("/v1/completions", json={"prompt": SECRET, "model": "nope"}).status_code == 404
        data = client.get("/dashboard/data").json()
    assert data["errors"]["totals"]["validation"] == before["validation"] + 2
    last = data["errors"]["recent"][-1]
    assert last["type"] == "validation" and last["status"] == 404 and last["model"] == "tiny-chat"
    assert set(last) == {"time", "type", "status", "route", "model"}
    assert SECRET not in str(data)


def test_dashboard_needs_the_api_key_when_keys_are_set(chat_model: Path) -> None:
    with run_server(chat_model, ServerConfig(api_keys=("k1",))) as running, running.client() as client:
        assert client.get("/dashboard").status_code == 401
        assert client.get("/dashboard/data").status_code == 401
        auth = {"Authorization": "Bearer k1"}
        assert client.get("/dashboard", headers=auth).status_code == 200
        data = client.get("/dashboard/data", headers=auth).json()
    assert data["errors"]["totals"]["unauthorized"] == 2


def test_no_dashboard_removes_the_page_but_keeps_the_metrics(chat_model: Path) -> None:
    with run_server(chat_model, ServerConfig(dashboard=False)) as running, running.client() as client:
        assert client.get("/dashboard").status_code == 404
        assert client.get("/dashboard/data").status_code == 404
        time.sleep(1.2)  # the sampler still runs: /metrics keeps its process figures
        assert 'tokenmill:process_resident_memory_bytes{model_name="tiny-chat",process="server"}' in (
            metrics_text_samples(running)
        )
