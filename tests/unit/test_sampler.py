"""The sampler against hand-computed references on small vocabularies: the parts that run in pure torch
(filters, penalties, logprobs, metadata). The sampler tests that reach the C++ draw and argmax kernels
(greedy rows, plain temperature draws) are in tests/kernels/test_sampler_kernels.py."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.outputs import Logprob
from tokenmill.sample import distribution
from tokenmill.sample.logprobs import compute_topk_logprobs, to_token_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_penalties
from tokenmill.sample.sampler import Sampler, SamplerOutput
from tokenmill.sampling_params import SamplingParams

VOCAB = 8
EOS = 7
CPU = torch.device("cpu")
# 99.9% quantile of the chi-square distribution with 7 degrees of freedom (VOCAB - 1).
CHI2_7_DOF_999 = 24.32


def build(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB,
    device: torch.device = CPU,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[0]] * n,
        output_token_ids=outputs or [[]] * n,
        generators=generators or [None] * n,
        eos_token_ids=[EOS],
        vocab_size=vocab_size,
        device=device,
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB,
) -> torch.Tensor:
    """The sampled ids of `logits`, with the metadata on the logits' device."""
    meta = build(params, outputs=outputs, generators=generators, vocab_size=vocab_size, device=logits.device)
    out: SamplerOutput = Sampler()(logits, meta)
    return out.sampled_token_ids


def draws(logits: torch.Tensor, params: SamplingParams, num: int = 4000) -> torch.Tensor:
    """`num` independent samples from one row of logits, drawn as one batch of identical rows."""
    return sample(logits.unsqueeze(0).repeat(num, 1), [params] * num)


def chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the sampled distribution


def test_top_k_samples_follow_the_renormalized_top_k_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5, 2.0, 0.0, 1.0, -2.0])
    samples = draws(logits, SamplingParams(temperature=1.0, top_k=3), num=20000)
    kept = [1, 3, 4]
    assert set(samples.tolist()) == set(kept)
    expected = torch.softmax(logits[kept], dim=-1)
    freq = torch.bincount(samples, minlength=VOCAB)[kept].float() / samples.numel()
    assert torch.allclose(freq, expected, atol=0.015)


def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_reaching_p() -> None:
    torch.manual_seed(2)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = torch.softmax(logits, dim=-1)
    # p(0) = 0.457 < 0.7 <= p(0) + p(1) = 0.735: tokens 0 and 1 are the nucleus.
    assert probs[:1].sum() < 0.7 <= probs[:2].sum()
    assert set(draws(logits, SamplingParams(top_p=0.7)).tolist()) == {0, 1}


def test_top_p_applies_to_what_top_k_left() -> None:
    torch.manual_seed(3)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    # After top_k=3 the renormalized probabilities are 0.51, 0.31, 0.19: 0.8 needs tokens 0 and 1 only.
    renormalized = torch.softmax(logits[:3], dim=-1)
    assert renormalized[:1].sum() < 0.8 <= renormalized[:2].sum()
    assert set(draws(logits, SamplingParams(top_k=3, top_p=0.8)).tolist()) == {0, 1}


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    torch.manual_seed(4)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = torch.softmax(logits, dim=-1)
    # p / p_max: token 1 -> e^-0.5 = 0.61 (kept), token 2 -> e^-1 = 0.37 (dropped).
    assert probs[1] >= 0.5 * probs[0] > probs[2]
    assert set(draws(logits, SamplingParams(min_p=0.5)).tolist()) == {0, 1}


def test_filters_apply_to_their_own_row_only() -> None:
    torch.manual_seed(5)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]).repeat(3000, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_k=2), SamplingParams(temperature=5.0)] * 1000
    out = sample(logits, params)
    assert set(out[0::3].tolist()) == {0}
    assert set(out[1::3].tolist()) == {0, 1}
    assert set(out[2::3].tolist()) == set(range(VOCAB))


# ---------------------------------------------------------------- penalties


def penalized(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    meta = build(params, outputs=outputs, prompts=prompts)
    out = logits.clone()
    apply_penalties(
        out,
        meta.prompt_token_ids,
        meta.output_token_ids,
        meta.repetition_penalty,
        meta.presence_penalty,
        meta.frequency_penalty,
    )
    return out


def reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """One token at a time: HF's repetition penalty over prompt + output, then OpenAI's
    `logit - count * frequency - (count > 0) * presence` over the output."""
    out = logits.clone()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for token in set(prompt) | set(output):
            x = float(out[row, token])
            out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(output):
            out[row, token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    return out


def test_repetition_penalty_pushes_seen_tokens_down_whatever_their_sign() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -3.0, 0.0, 0.0, 0.0]])
    out = penalized(logits, [SamplingParams(repetition_penalty=2.0)], prompts=[[0, 4]], outputs=[[1]])
    # seen: 0 (prompt, 2 / 2), 4 (prompt, -3 * 2), 1 (output, -1 * 2); 2 and 3 were never seen.
    expected = torch.tensor([[1.0, -2.0, 0.5, 1.0, -6.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalized(logits, [params], prompts=[[0, 2]], outputs=[[1, 3, 3]])
    # token 1 once: -1 - 0.5 - 0.25; token 3 twice: 1 - 0.5 - 2 * 0.25; prompt tokens 0 and 2 untouched.
    expected = torch.tensor([[2.0, -1.75, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)


def test_penalties_match_a_per_token_reference_on_a_ragged_batch() -> None:
    gen = seeded(6)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
        SamplingParams(),  # no penalties: its row must come back untouched
        SamplingParams(presence_penalty=-1.0, repetition_penalty=1.7),
    ]
    prompts = [[0, 1, 1, 5], [2], [3, 4, 5, 6, 7], [7, 7, 0]]
    outputs = [[1, 2, 2, 2, 6], [], [0, 0], [3, 7, 3]]
    out = penalized(logits, params, prompts, outputs)
    assert torch.allclose(out, reference_penalties(logits, params, prompts, outputs))
    assert torch.equal(out[2], logits[2])


# ---------------------------------------------------------------- logprobs


def test_compute_topk_logprobs_with_k_zero_gives_the_target_only() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 1.0]]), dim=-1)
    ids, values, ranks = compute_topk_logprobs(logprobs, torch.tensor([2, 0]), k=0)
    assert ids.tolist() == [[2], [0]]
    assert torch.equal(values, logprobs[[0, 1], [2, 0]].unsqueeze(1))
    assert ranks.tolist() == [2, 1]


def test_to_token_logprobs_gives_the_target_its_rank_and_the_top_k_ranks_1_to_k() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]]), dim=-1)
    ids, values, ranks = compute_topk_logprobs(logprobs, torch.tensor([0, 2]), k=2)
    lp = logprobs[0].tolist()
    entries = to_token_logprobs(ids, values, ranks)
    # Row 0: target 0 is 4th; row 1: target 2 is also the 2nd of the top 2, so it appears once.
    assert entries[0] == {0: Logprob(lp[0], 4), 1: Logprob(lp[1], 1), 2: Logprob(lp[2], 2)}
    assert entries[1] == {2: Logprob(lp[2], 2), 1: Logprob(lp[1], 1)}
    # Per-row k for a batch whose requests asked for different numbers.
    trimmed = to_token_logprobs(ids, values, ranks, num_logprobs=[0, 1])
    assert trimmed == [{0: Logprob(lp[0], 4)}, {2: Logprob(lp[2], 2), 1: Logprob(lp[1], 1)}]
    assert math.isclose(sum(math.exp(v) for v in lp), 1.0, rel_tol=1e-6)


# ---------------------------------------------------------------- metadata


def test_a_plain_greedy_batch_takes_every_fast_path() -> None:
    meta = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)] * 2, prompts=[[1, 2], [3]])
    assert meta.all_greedy and meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.no_penalties and meta.no_logit_bias and meta.no_min_tokens
    assert meta.max_num_logprobs is None
    assert meta.prompt_token_ids.shape == (2, 0) and meta.output_token_ids.shape == (2, 0)


def test_flags_turn_off_only_for_what_some_request_uses() -> None:
    params = [
        SamplingParams(top_k=4, logprobs=2),
        SamplingParams(top_k=VOCAB, min_p=0.1, presence_penalty=0.5, logprobs=5),  # top_k = vocab is no filter
    ]
    meta = build(params, prompts=[[1, 2, 3], [4]], outputs=[[5], [6, 6]])
    assert not meta.all_greedy and not meta.no_top_k and meta.no_top_p and not meta.no_min_p
    assert not meta.no_penalties and meta.no_logit_bias
    assert meta.max_num_logprobs == 5
    assert meta.top_k.tolist() == [4, VOCAB]
    # Only the repetition penalty reads the prompt; presence and frequency read the output.
    assert meta.prompt_token_ids.shape == (2, 0)
    assert meta.output_token_ids.tolist() == [[5, VOCAB], [6, 6]]


def test_build_rejects_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingMetadata.build([SamplingParams()], [[1]], [[], []], [None], [EOS], VOCAB, CPU)


def test_build_rejects_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build([SamplingParams(logit_bias={VOCAB: 1.0})])


@pytest.mark.parametrize("vocab_size", [1000, 49152])
def test_top_k_top_p_among_candidates_keeps_what_the_full_sort_keeps(vocab_size: int) -> None:
    """The candidate path (the TOP_CANDIDATES most likely tokens) and the whole sorted row keep the same
    tokens, for rows it answers (small top-k, a nucleus inside the candidates) and rows it hands to the
    sort (a flat distribution whose nucleus is wider, a top-k past the candidates, no filter at all)."""
    gen = torch.Generator().manual_seed(0)
    rows = 8
    logits = torch.randn(rows, vocab_size, generator=gen) * 3
    logits[1] /= 100  # nearly flat: the nucleus spans most of the vocabulary
    top_k = torch.tensor([vocab_size, vocab_size, vocab_size, 40, 600, vocab_size, 1, 5])
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.9, 1.0, 0.3, 0.99])
    fast, full = logits.clone(), logits.clone()
    distribution._apply_top_k_top_p(fast, top_k, top_p)
    distribution._apply_top_k_top_p_sorted(full, top_k, top_p)
    assert torch.equal(fast.isfinite(), full.isfinite())
    kept = full.isfinite()
    assert torch.equal(fast[kept], logits[kept])
    assert kept[2].all() and kept[5].all()  # no filter
    assert kept[1].sum() > distribution.TOP_CANDIDATES and kept[7].sum() == 5  # the sort; a top-k of 5
