"""The benchmarks through the engine: the throughput runner, `tokenmill bench throughput`, and `tokenmill
bench compare` running tokenmill through its driver. The workloads, the driver protocol and the roofline
arithmetic, without an engine: tests/unit/test_bench.py and tests/unit/test_bench_compare.py.

Engine runs use the tiny llama (vocab 512, max_model_len 512), so their workloads are capped with
max_prompt_len / max_output_len to fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill.bench import make_workload, run_throughput
from tokenmill.bench.compare import CompareOptions, run_compare
from tokenmill.bench.roofline import MachineRates
from tokenmill.cli import main


def _tiny_llm(model: Path, **kwargs: object) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=128, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("static_batching", [False, True], ids=["continuous", "static"])
def test_run_throughput_counts_every_output_token(llama_model: Path, static_batching: bool) -> None:
    requests = make_workload("random-cpu", 512, num_requests=5, max_prompt_len=96, max_output_len=12)
    llm = _tiny_llm(llama_model)
    result = run_throughput(llm, requests, static_batching, batch_size=2)
    assert result.num_requests == 5
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert result.prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert result.output_tok_s == pytest.approx(result.output_tokens / result.elapsed_s)
    assert result.total_tok_s == pytest.approx((result.prompt_tokens + result.output_tokens) / result.elapsed_s)
    assert 0.0 < result.kv_slot_utilization <= 1.0
    assert result.num_preemptions == 0
    # Each prompt fits one step, which samples its first token; every later token comes from a
    # decode-only step (so does all but the first of the warm-up's 4).
    assert llm.engine.decode_stats.tokens == sum(r.output_len - 1 for r in requests) + 3
    assert result.decode_tok_s > 0.0


def test_static_batching_waits_for_each_batch_to_finish(llama_model: Path) -> None:
    # Every output is 10 tokens (random-cpu's are >= 32, capped): one continuous batch of 5 takes about
    # 10 steps; three static batches (2 + 2 + 1) take at least 10 steps each, since a batch is not
    # refilled until all of it has finished.
    requests = make_workload("random-cpu", 512, num_requests=5, max_prompt_len=64, max_output_len=10)
    llm = _tiny_llm(llama_model)
    continuous = run_throughput(llm, requests, static_batching=False)
    static = run_throughput(llm, requests, static_batching=True, batch_size=2)
    assert continuous.num_steps < 2 * 10 < 3 * 10 <= static.num_steps
    assert static.batch_size == 2 and continuous.batch_size is None


def test_prefix_cache_hit_rate_covers_the_timed_window_only(llama_model: Path) -> None:
    # One request at a time: requests 2..4 find the 136 shared tokens left by the cap, as 8 full blocks
    # of 16. The warm-up's prompt is looked up too, but before the window.
    requests = make_workload("shared-prefix", 512, num_requests=4, max_prompt_len=200, max_output_len=4)
    result = run_throughput(_tiny_llm(llama_model), requests, static_batching=True, batch_size=1)
    assert result.prefix_cache_hit_rate == pytest.approx(3 * 128 / (4 * 200))


def test_cli_bench_throughput_runs_end_to_end(
    llama_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    main(
        [
            "bench",
            "throughput",
            "--model",
            str(llama_model),
            "--workload",
            "fixed-128-1024",
            "--num-prompts",
            "2",
            "--max-output-len",
            "16",
            "--num-kv-blocks",
            "64",
            "--max-num-seqs",
            "4",
            "--output-json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    for row in (
        "requests/s",
        "output tok/s",
        "total tok/s",
        "KV-slot utilisation",
        "prefix cache hit rate",
        "preemptions",
    ):
        assert row in printed
    report = json.loads(out.read_text())
    assert report["results"]["output_tokens"] == 2 * 16
    assert report["results"]["prompt_tokens"] == 2 * 128
    assert report["config"]["max_num_seqs"] == 4 and report["config"]["num_kv_blocks"] == 64
    assert report["machine"]["cpu_model"] and report["machine"]["torch"]
    assert report["args"]["workload"] == "fixed-128-1024" and "command" in report


def test_cli_bench_throughput_rejects_a_workload_longer_than_the_context(
    llama_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "throughput",
                "--model",
                str(llama_model),
                "--workload",
                "fixed-128-1024",
                "--num-prompts",
                "2",
                "--num-kv-blocks",
                "64",
            ]
        )
    assert exit_info.value.code == 2
    assert "--max-output-len" in capsys.readouterr().err


def test_compare_runs_tokenmill_through_its_driver(
    llama_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setattr(
        "tokenmill.bench.roofline.measure_rates",
        lambda shape, dtype, batch, threads: MachineRates(20e9, 100e9, dtype, batch, threads),
    )
    opts = CompareOptions(
        workload="random-cpu",
        model=str(llama_model),
        dtype="float32",
        num_prompts=2,
        max_prompt_len=16,
        max_output_len=4,
        repeat=2,
        threads=1,
    )
    report = run_compare(opts, log=lambda _: None)
    [tm] = report.engines
    assert tm.status == "ok", tm.error
    assert len(tm.runs) == 2 and all(r["output_tokens"] == r["generated_tokens"] == 2 * 4 for r in tm.runs)
    assert tm.ratio_to_tokenmill == 1.0


def test_calibrate_writes_a_profile_the_planner_reads(llama_model: Path, tmp_path: Path) -> None:
    from tokenmill.bench.calibrate import calibrate
    from tokenmill.planner.step_model import load_profile

    requests = make_workload("random-cpu", 512, num_requests=6, max_prompt_len=96, max_output_len=12)
    llm = _tiny_llm(llama_model, max_num_seqs=16)
    data = calibrate(llm, requests)
    assert [p["rows"] for p in data["decode_points"]] == [1, 4, 16]  # the batches max_num_seqs allows
    assert all(p["step_s"] > 0 for p in data["decode_points"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    profile = load_profile(path)
    assert profile.costs.max_num_seqs == 16
    assert profile.costs.prefill_per_token_s > 0
    assert profile.lengths == [(len(r.prompt_token_ids), r.output_len) for r in requests]
