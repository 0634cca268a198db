"""The benchmark workloads: counts, length ranges, seeds and caps, against docs/benchmarking.md's table.
The throughput runner and `tokenmill bench throughput` on an engine: tests/e2e/test_bench_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.bench import WORKLOADS, check_fits, make_workload

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
    # copy-edit (text through a tokenizer): tests/unit/test_copy_edit_workload.py
    assert set(WORKLOADS) == set(STANDARD) | {"copy-edit"}


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
