"""`tokenmill bench serve` against a live tokenmill server: every request completes, token counts come
from the server's usage, and the report has every metric."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.server.conftest import RunningServer
from tokenmill.bench.datasets import make_workload
from tokenmill.bench.serve import add_serve_parser, parse_goodput, summarize


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_summary_counts_the_servers_tokens(server: RunningServer) -> None:
    import asyncio

    from tokenmill.bench.serve import run_load

    requests = make_workload("random-cpu", 512, seed=1, num_requests=6, max_prompt_len=40, max_output_len=12)
    raw, duration = asyncio.run(run_load(server.url, "tiny-chat", requests, 50.0, 3, seed=1))
    result = summarize(raw, duration, 50.0, 3, parse_goodput(["ttft:60000", "tpot:60000"]))
    assert result.completed == 6 and result.failed == 0
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert result.prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert result.goodput == pytest.approx(result.request_throughput)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = result.latency_ms[metric]
        assert 0 < stats["median"] <= stats["p99"]
    assert result.latency_ms["ttft"]["median"] < result.latency_ms["e2el"]["median"]


def test_cli_writes_a_json_report_and_a_sweep_plot(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = [
        "serve",
        "--base-url",
        server.url,
        "--num-prompts",
        "4",
        "--vocab-size",
        "512",
        "--max-prompt-len",
        "32",
        "--max-output-len",
        "6",
        "--sweep",
        "20,inf",
        "--plot",
        str(tmp_path / "sweep.png"),
        "--goodput",
        "ttft:60000",
        "--output-json",
        str(out),
    ]
    args = _parse(argv)
    args.func(args)
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-chat"
    assert [r["request_rate"] for r in report["results"]] == [20.0, "inf"]
    assert all(r["completed"] == 4 for r in report["results"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "sweep.png").stat().st_size > 0


def test_goodput_slos_are_checked() -> None:
    assert parse_goodput(["ttft:2000", "tpot:100"]) == {"ttft": 2000.0, "tpot": 100.0}
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_goodput(["latency:5"])
    assert math.isinf(_parse(["serve"]).request_rate)
