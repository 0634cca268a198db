"""The sampler where it runs the C++ CPU ops (tokenmill/ops/csrc/cpu_ops.cpp): the draw and argmax kernels
against their torch references, and the sampler tests whose float32 CPU logits reach them where they
build (greedy rows: the argmax kernel; plain temperature draws: the draw kernel). Without a compiler the
same tests run the torch path. The sampler's pure-torch parts (filters, penalties, logprobs, metadata)
are in tests/unit/test_sampler.py, whose helpers these tests share. The AVX2 build (vectorized softmax
weights and row maxima there too) runs this file again in a subprocess (the last test)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.unit.test_sampler import CHI2_7_DOF_999, EOS, VOCAB, build, chi_square, draws, sample, seeded
from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

# ---------------------------------------------------------------- greedy


def test_greedy_picks_the_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 5).tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_ignore_filters_and_seeds() -> None:
    logits = torch.randn(4, VOCAB)
    params = [
        SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
    ]
    out = sample(logits, params, generators=[seeded(3), None, None, None])
    assert out[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_sampler_leaves_the_callers_logits_unchanged_and_accepts_half_precision() -> None:
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.5, logit_bias={1: 2.0})] * 3
    out = Sampler()(logits, build(params, outputs=[[1, 2]] * 3))
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (3,)
    # float32 and a plain draw mixed with greedy: sampled without a copy, still read only.
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    Sampler()(logits, build([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)] * 2))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- the sampled distribution


def test_samples_follow_softmax_of_logits_over_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.3, 0.1])
    samples = draws(logits, SamplingParams(temperature=0.7), num=20000)
    assert chi_square(samples, torch.softmax(logits / 0.7, dim=-1)) < CHI2_7_DOF_999


# ---------------------------------------------------------------- seeds


def test_a_seeded_row_draws_its_noise_from_its_own_generator() -> None:
    # Reference: inverse CDF, the first token whose cumulative probability exceeds one uniform drawn
    # from the request's generator.
    logits = torch.randn(1, 1000)
    u = torch.rand(1, dtype=torch.float64, generator=seeded(42)).item()
    cdf = torch.softmax(logits[0] / 0.9, dim=-1).double().cumsum(0)
    expected = int((cdf <= u * cdf[-1]).sum())
    assert sample(logits, [SamplingParams(temperature=0.9, seed=42)], generators=[seeded(42)]).item() == expected


def inverse_cdf_reference(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The torch path: float32 softmax, float64 cumulative sum, first token whose cdf exceeds u * total."""
    cdf = torch.softmax(logits / temperature.unsqueeze(1), dim=-1).double().cumsum(-1)  # [rows, vocab]
    return (cdf <= (uniform * cdf[:, -1]).unsqueeze(1)).sum(-1).clamp(max=logits.shape[1] - 1)


def test_the_cpu_sampling_kernel_draws_what_the_inverse_cdf_does() -> None:
    ops = cpu_ops(torch.zeros(1))
    if ops is None:
        pytest.skip("the C++ CPU ops could not be built here")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49157, generator=gen) * 3  # a vocabulary that is not a whole number of chunks
    logits[:, ::7] = float("-inf")  # masked tokens (logit_bias, min_tokens)
    temperature = torch.rand(64, generator=gen) + 0.3
    uniform = torch.rand(64, dtype=torch.float64, generator=gen)
    got = ops.sample_rows(logits, temperature, uniform)
    assert torch.equal(got, inverse_cdf_reference(logits, temperature, uniform))
    # The ends of the cdf land on the first and the last token of nonzero probability, never a masked one.
    ends = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    edge = torch.full((2, 40), -30.0)
    edge[:, [0, 1, 38, 39]] = float("-inf")
    assert ops.sample_rows(edge, torch.ones(2), ends).tolist() == [2, 37]
    assert ops.sample_rows(torch.full((1, 5), float("-inf")), torch.ones(1), ends[:1]).tolist() == [0]


def test_the_cpu_argmax_kernel_picks_what_torch_argmax_does() -> None:
    ops = cpu_ops(torch.zeros(1))
    if ops is None:
        pytest.skip("the C++ CPU ops could not be built here")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49157, generator=gen).round(decimals=1) * 3  # many equal values: ties
    logits[1] = float("-inf")  # every token masked
    logits[2, 5:] = 1e4  # the largest value from index 5 on: the first wins
    logits[3, 49150] = float("nan")  # a NaN counts as the largest, as in torch
    logits[4, [9, 49156]] = float("nan")
    logits[5, 49156] = float("inf")
    logits[6, 49141:] = 50.0  # the maximum in the tail past the last whole vector
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert ops.argmax_rows(logits[:, :3].contiguous()).tolist() == logits[:, :3].argmax(dim=-1).tolist()


def test_a_seed_fixes_the_draw_whatever_the_batch_position_and_neighbours() -> None:
    vocab = 1000  # a wide, flat vocabulary: an accidental match is unlikely
    logits = torch.randn(6, vocab) * 0.1
    # Row 3 is seeded (42), row 1 too (7), the others use the default generator.
    seeds: list[int | None] = [None, 7, None, 42, None, None]
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in seeds]

    def draw_of_row_3(rows: list[int]) -> int:
        gens = [None if seeds[r] is None else seeded(seeds[r] or 0) for r in rows]
        out = sample(logits[rows], [params[r] for r in rows], generators=gens, vocab_size=vocab)
        return int(out[rows.index(3)])

    alone = draw_of_row_3([3])
    assert draw_of_row_3([0, 1, 2, 3, 4, 5]) == alone
    assert draw_of_row_3([5, 3, 1]) == alone
    assert draw_of_row_3([1, 0, 4, 2, 5, 3]) == alone


def test_different_seeds_draw_different_tokens() -> None:
    vocab = 1000
    logits = torch.zeros(5, vocab)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(5)]
    out = sample(logits, params, generators=[seeded(s) for s in range(5)], vocab_size=vocab)
    assert len(set(out.tolist())) == 5


# ---------------------------------------------------------------- bias, min_tokens


def test_logit_bias_is_added_to_the_logits_and_can_force_a_token() -> None:
    logits = torch.randn(2, VOCAB)
    weakest = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.0, logit_bias={weakest: 100.0}), SamplingParams(temperature=0.0)]
    assert sample(logits, params).tolist() == [weakest, int(logits[1].argmax())]
    # A bias of -100 on the favourite hands the win to the runner-up.
    runner_up = int(logits[1].topk(2).indices[1])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100}),
    ]
    assert sample(logits, params)[1].item() == runner_up


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0  # a stop token
    logits[:, 2] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    out = sample(logits, [params] * 3, outputs=[[1], [1, 1], [1, 1, 1]])
    assert out.tolist() == [2, 2, EOS]


def test_min_tokens_with_ignore_eos_leaves_eos_allowed() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 11.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert sample(logits, [params], outputs=[[1]]).tolist() == [EOS]


def test_min_tokens_mask_beats_a_positive_logit_bias() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=0.0, min_tokens=1, logit_bias={EOS: 100.0, 3: 1.0})
    assert sample(logits, [params]).tolist() == [3]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB)
    # Temperature, filters, penalties and bias change what is sampled, not the reported distribution.
    params = [
        SamplingParams(temperature=0.3, top_k=2, logprobs=3, repetition_penalty=1.5, logit_bias={4: 5.0}),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=2.0),
    ]
    out = Sampler()(logits, build(params, outputs=[[4, 5], [], [1]]))
    assert out.topk_token_ids is not None and out.topk_logprobs is not None and out.sampled_ranks is not None
    ref = torch.log_softmax(logits, dim=-1)  # [3, VOCAB]
    top3 = ref.topk(3, dim=-1)
    assert out.topk_token_ids.shape == (3, 4)  # k = the largest request (3), plus the sampled token
    assert torch.equal(out.topk_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.topk_token_ids[:, 1:], top3.indices)
    assert torch.allclose(out.topk_logprobs[:, 1:], top3.values)
    assert torch.allclose(out.topk_logprobs[:, 0], ref.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1))


def test_the_sampled_token_is_reported_with_its_rank_even_outside_the_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 50.0})
    out = Sampler()(logits, build([params]))
    ref = torch.log_softmax(logits, dim=-1)[0]
    assert out.topk_token_ids is not None and out.topk_logprobs is not None and out.sampled_ranks is not None
    assert out.sampled_token_ids.tolist() == [4]
    assert out.topk_token_ids[0].tolist() == [4, 1, 2]
    assert torch.allclose(out.topk_logprobs[0], ref[[4, 1, 2]])
    assert out.sampled_ranks.tolist() == [5]  # 3.0, 2.0, 1.0 and 0.0 are more likely than -1.0


def test_no_logprobs_are_computed_when_nobody_asks() -> None:
    out = Sampler()(torch.randn(2, VOCAB), build([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert out.topk_token_ids is None and out.topk_logprobs is None and out.sampled_ranks is None


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
