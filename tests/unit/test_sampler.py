"""The sampler against hand-computed references on small vocabularies."""

from __future__ import annotations

import torch

from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_penalties
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

VOCAB = 8


def meta(params: list[SamplingParams], outputs: list[list[int]] | None = None,
         prompts: list[list[int]] | None = None, generators: list | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, prompts or [[0]] * n, outputs or [[]] * n, generators or [None] * n,
        eos_token_ids=[7], vocab_size=VOCAB, device=torch.device("cpu"),
    )


def draws(logits: torch.Tensor, params: SamplingParams, num: int = 4000) -> torch.Tensor:
    """`num` samples from one row, drawn as one batch of identical rows."""
    batch = logits.unsqueeze(0).repeat(num, 1)
    return Sampler()(batch, meta([params] * num)).sampled_token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    out = Sampler()(logits, meta([SamplingParams(temperature=0.0)] * 5))
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_samples_follow_softmax_of_logits_over_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.3, 0.1])
    samples = draws(logits, SamplingParams(temperature=0.7), num=20000)
    freq = torch.bincount(samples, minlength=VOCAB).float() / samples.numel()
    expected = torch.softmax(logits / 0.7, dim=-1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_top_k_top_p_and_min_p_never_pick_filtered_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = torch.softmax(logits, dim=-1)
    assert set(draws(logits, SamplingParams(top_k=2)).tolist()) == {0, 1}
    # top_p=0.7: tokens 0 (p=.45) and 1 (p=.27) reach it; token 2 starts beyond it.
    assert probs[:2].sum() >= 0.7 > probs[:1].sum()
    assert set(draws(logits, SamplingParams(top_p=0.7)).tolist()) == {0, 1}
    # min_p=0.5 keeps tokens with p >= 0.5 * p_max: tokens 0 and 1 (0.27/0.45 = 0.61), not 2 (0.37).
    assert set(draws(logits, SamplingParams(min_p=0.5)).tolist()) == {0, 1}


def test_a_seed_fixes_the_draw_whatever_the_batch() -> None:
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=1.0) for _ in range(6)]
    params[3] = SamplingParams(temperature=1.0, seed=42)

    def seeded_draw(rows: list[int]) -> int:
        gens = [torch.Generator().manual_seed(42) if r == 3 else None for r in rows]
        out = Sampler()(logits[rows], meta([params[r] for r in rows], generators=gens))
        return int(out.sampled_token_ids[rows.index(3)])

    alone = seeded_draw([3])
    assert seeded_draw([0, 1, 2, 3, 4, 5]) == alone
    assert seeded_draw([5, 3, 1]) == alone


def test_repetition_presence_and_frequency_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]])
    out = apply_penalties(
        logits.clone(), torch.tensor([[0, 8]]), torch.tensor([[1, 3, 3]]),
        torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]),
    )
    # token 0 seen in the prompt: 2.0 / 2; token 1 output once: -1 * 2 - 0.5 - 0.25;
    # token 3 output twice: 1.0 / 2 - 0.5 - 2 * 0.25; the rest untouched.
    expected = torch.tensor([[1.0, -2.75, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(out, expected)


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(1, VOCAB)
    weakest = int(logits.argmin())
    out = Sampler()(logits, meta([SamplingParams(temperature=0.0, logit_bias={weakest: 100.0})]))
    assert int(out.sampled_token_ids[0]) == weakest


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0  # eos
    logits[:, 5] = 9.0  # a stop token
    logits[:, 2] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    out = Sampler()(logits, meta([params, params], outputs=[[1], [1, 1, 1]]))
    assert out.sampled_token_ids.tolist() == [2, 7]


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    # temperature and bias change what is sampled (token 4), not the reported distribution.
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 50.0})
    out = Sampler()(logits, meta([params]))
    ref = torch.log_softmax(logits, dim=-1)[0]
    assert out.sampled_token_ids.tolist() == [4]
    assert out.topk_token_ids is not None and out.topk_logprobs is not None and out.sampled_ranks is not None
    assert out.topk_token_ids[0].tolist() == [4, 1, 2]
    assert torch.allclose(out.topk_logprobs[0], ref[[4, 1, 2]])
    assert out.sampled_ranks.tolist() == [5]
