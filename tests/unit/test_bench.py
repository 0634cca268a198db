"""The benchmark workloads, the throughput runner and `tokenmill bench throughput`.

The workload table is docs/benchmarking.md's; engine runs use the tiny llama (vocab 512, max_model_len 512),
so their workloads are capped with max_prompt_len / max_output_len to fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenmill import LLM
from tokenmill.bench import WORKLOADS, check_fits, make_workload, run_throughput
from tokenmill.cli import main

# name: (requests, prompt length range, output length range, temperature), from docs/benchmarking.md
STANDARD = {
    "random-cpu": (64, (64, 512), (32, 256), 0.6),
    "random-gpu": (256, (100, 1024), (100, 1024), 0.6),
    "sharegpt-like": (256, (1, 1024), (1, 2048), 1.0),
    "shared-prefix": (64, (1088, 1088), (128, 128), 1.0),
    "fixed-1024-128": (64, (1024, 1024), (128, 128), 1.0),
    "fixed-128-1024": (64, (128, 128), (1024, 1024), 1.0),
}
VOCAB = 49_152  # SmolLM2's


def test_the_registry_holds_exactly_the_standard_workloads() -> None:
    assert set(WORKLOADS) == set(STANDARD)


@pytest.mark.parametrize("name", list(STANDARD))
def test_workload_has_its_standard_count_and_length_ranges(name: str) -> None:
    count, (p_lo, p_hi), (o_lo, o_hi), temperature = STANDARD[name]
    requests = make_workload(name, VOCAB)
    assert len(requests) == count
    assert all(p_lo <= len(r.prompt_token_ids) <= p_hi for r in requests)
    assert all(o_lo <= r.output_len <= o_hi for r in requests)
    assert all(r.temperature == temperature for r in requests)


@pytest.mark.parametrize("name", list(STANDARD))
def test_every_request_ignores_eos_and_runs_to_its_output_len(name: str) -> None:
    for r in make_workload(name, VOCAB, num_requests=4):
        params = r.sampling_params()
        assert params.ignore_eos and params.max_tokens == r.output_len


@pytest.mark.parametrize("name", list(STANDARD))
def test_workload_is_identical_for_a_seed_and_differs_across_seeds(name: str) -> None:
    assert make_workload(name, VOCAB, seed=3) == make_workload(name, VOCAB, seed=3)
    assert make_workload(name, VOCAB, seed=3) != make_workload(name, VOCAB, seed=4)


def test_uniform_lengths_span_their_range() -> None:
    requests = make_workload("random-cpu", VOCAB)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    assert min(prompt_lens) < 128 and max(prompt_lens) > 448  # not a constant, not a narrow band


def test_token_ids_are_drawn_below_10000_or_the_vocabulary() -> None:
    big = [t for r in make_workload("random-cpu", VOCAB) for t in r.prompt_token_ids]
    assert 0 <= min(big) and max(big) < 10_000 and max(big) > 9_000
    small = [t for r in make_workload("random-cpu", 512) for t in r.prompt_token_ids]
    assert max(small) < 512


def test_sharegpt_like_is_right_skewed_with_the_documented_means() -> None:
    requests = make_workload("sharegpt-like", VOCAB)
    prompt_lens = np.array([len(r.prompt_token_ids) for r in requests])
    output_lens = np.array([r.output_len for r in requests])
    assert prompt_lens.mean() == pytest.approx(226, rel=0.15)
    assert output_lens.mean() == pytest.approx(199, rel=0.15)
    assert np.median(prompt_lens) < prompt_lens.mean() and np.median(output_lens) < output_lens.mean()
    assert max(r.total_len for r in requests) <= 2048


def test_shared_prefix_requests_share_their_first_1024_tokens_and_no_more() -> None:
    requests = make_workload("shared-prefix", VOCAB)
    prefix = requests[0].prompt_token_ids[:1024]
    assert all(r.prompt_token_ids[:1024] == prefix for r in requests)
    tails = {tuple(r.prompt_token_ids[1024:]) for r in requests}
    assert len(tails) == len(requests)  # each request's 64 tokens are its own


def test_num_requests_overrides_the_count() -> None:
    assert len(make_workload("random-gpu", VOCAB, num_requests=5)) == 5


def test_caps_keep_the_last_prompt_tokens_and_shorten_outputs() -> None:
    full = make_workload("shared-prefix", VOCAB)
    capped = make_workload("shared-prefix", VOCAB, max_prompt_len=100, max_output_len=10)
    assert [r.prompt_token_ids for r in capped] == [r.prompt_token_ids[-100:] for r in full]
    assert all(r.output_len == 10 for r in capped)
    assert len({tuple(r.prompt_token_ids[:36]) for r in capped}) == 1  # what is left of the prefix


def test_unknown_workload_is_a_value_error_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="random-cpu"):
        make_workload("sharegpt", VOCAB)


def test_check_fits_says_how_to_fit_a_short_context() -> None:
    requests = make_workload("fixed-128-1024", VOCAB, num_requests=2)
    check_fits(requests, 1152)
    with pytest.raises(ValueError, match="--max-output-len"):
        check_fits(requests, 512)


# ---------------------------------------------------------------------------------- engine runs
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
    main(["bench", "throughput", "--model", str(llama_model), "--workload", "fixed-128-1024",
          "--num-prompts", "2", "--max-output-len", "16", "--num-kv-blocks", "64", "--max-num-seqs", "4",
          "--output-json", str(out)])
    printed = capsys.readouterr().out
    for row in ("requests/s", "output tok/s", "total tok/s", "KV-slot utilisation", "prefix cache hit rate",
                "preemptions"):
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
        main(["bench", "throughput", "--model", str(llama_model), "--workload", "fixed-128-1024",
              "--num-prompts", "2", "--num-kv-blocks", "64"])
    assert exit_info.value.code == 2
    assert "--max-output-len" in capsys.readouterr().err
