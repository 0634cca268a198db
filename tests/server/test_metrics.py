"""/metrics exposes vLLM's metric names under the `tokenmill:` prefix, and they move with traffic."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import RunningServer

EXPECTED = [
    "tokenmill:num_requests_running",
    "tokenmill:num_requests_waiting",
    "tokenmill:kv_cache_usage_perc",
    "tokenmill:num_preemptions",
    "tokenmill:prompt_tokens",
    "tokenmill:generation_tokens",
    "tokenmill:request_success",
    "tokenmill:prefix_cache_queries",
    "tokenmill:prefix_cache_hits",
    "tokenmill:time_to_first_token_seconds",
    "tokenmill:inter_token_latency_seconds",
    "tokenmill:e2e_request_latency_seconds",
    "tokenmill:request_queue_time_seconds",
    "tokenmill:request_prefill_time_seconds",
    "tokenmill:request_decode_time_seconds",
    "tokenmill:iteration_tokens_total",
    "tokenmill:avg_prompt_throughput_toks_per_s",
    "tokenmill:avg_generation_throughput_toks_per_s",
]


def scrape(server: RunningServer) -> dict[str, float]:
    with server.client() as client:
        text = client.get("/metrics").text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["finished_reason"] + "}" if "finished_reason" in s.labels else "")
            if "le" not in s.labels:
                samples[key] = s.value
    return samples


def test_metrics_have_vllm_names_and_count_traffic(server: RunningServer) -> None:
    before = scrape(server)
    with server.client() as client:
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200
    server.wait_idle()
    after = scrape(server)
    names = {
        k.split("{")[0].removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_created")
        for k in after
    }
    for name in EXPECTED:
        assert name in names or name.removesuffix("_total") in names, name

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tokenmill:prompt_tokens_total") == 3
    assert delta("tokenmill:generation_tokens_total") == 5
    assert delta("tokenmill:request_success_total{length}") == 1
    assert delta("tokenmill:time_to_first_token_seconds_count") == 1
    assert delta("tokenmill:inter_token_latency_seconds_count") == 4
    assert delta("tokenmill:e2e_request_latency_seconds_count") == 1
    assert delta("tokenmill:prefix_cache_queries_total") >= 3
