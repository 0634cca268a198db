"""Speculative verification (tokenmill.sample.rejection): the emitted tokens follow the target's
distribution p whatever the draft's q, checked by a chi-square goodness-of-fit test on seeded draws;
then the edge cases by hand, and greedy verification."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample import rejection
from tokenmill.sample.rejection import greedy_verify, rejection_sample

NUM_DRAWS = 20_000
# 99.9% quantiles of the chi-square distribution (scipy.stats.chi2.ppf(0.999, dof); any chi-square table).
CHI2_999 = {4: 18.467, 5: 20.515}
# The target and a draft that disagrees with it: the draft over-proposes the tail tokens.
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the tokens' counts against the expected counts under probs, over the
    tokens probs can emit, and its degrees of freedom."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).to(torch.float64)
    support = probs > 0
    expected = probs.to(torch.float64)[support] * len(tokens)
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    return statistic, int(support.sum().item()) - 1


def one_draft_per_request(
    p: torch.Tensor, q: torch.Tensor | None, seed: int, drafts: list[int] | None = None
) -> list[list[int]]:
    """NUM_DRAWS requests, each with one draft (drawn from q, or the given deterministic drafts when q
    is None) and the target's rows [p, p]."""
    generator = torch.Generator().manual_seed(seed)
    if drafts is None:
        assert q is not None
        drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=generator).tolist()
    target_probs = p.repeat(2 * NUM_DRAWS, 1)  # [2 * NUM_DRAWS, vocab]
    draft_probs = None if q is None else q.repeat(NUM_DRAWS, 1)  # [NUM_DRAWS, vocab]
    return rejection_sample(
        target_probs,
        [[d] for d in drafts],
        draft_probs,
        torch.rand(NUM_DRAWS, dtype=torch.float64, generator=generator),
        torch.rand(NUM_DRAWS, dtype=torch.float64, generator=generator),
    )


def test_first_token_follows_p_with_a_draft_sampled_from_q() -> None:
    outputs = one_draft_per_request(P, Q, seed=0)
    statistic, dof = chi_square([out[0] for out in outputs], P)
    assert statistic < CHI2_999[dof]


def test_first_token_follows_p_with_deterministic_drafts() -> None:
    drafts = [i % len(P) for i in range(NUM_DRAWS)]  # every token proposed, one-hot q
    outputs = one_draft_per_request(P, None, seed=1, drafts=drafts)
    statistic, dof = chi_square([out[0] for out in outputs], P)
    assert statistic < CHI2_999[dof]


def test_a_draft_is_accepted_with_probability_sum_of_min_p_q() -> None:
    outputs = one_draft_per_request(P, Q, seed=2)
    acceptance = sum(len(out) == 2 for out in outputs) / NUM_DRAWS
    expected = torch.minimum(P, Q).sum().item()  # 0.55
    std = (expected * (1 - expected) / NUM_DRAWS) ** 0.5
    assert abs(acceptance - expected) < 5 * std


def test_the_token_after_an_accepted_draft_follows_the_next_row() -> None:
    p_next = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])
    generator = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(Q, 2 * NUM_DRAWS, replacement=True, generator=generator).view(NUM_DRAWS, 2)
    target_probs = torch.stack([P, p_next, P]).repeat(NUM_DRAWS, 1)  # [3 * NUM_DRAWS, vocab]
    outputs = rejection_sample(
        target_probs,
        drafts.tolist(),
        Q.repeat(2 * NUM_DRAWS, 1),
        torch.rand(2 * NUM_DRAWS, dtype=torch.float64, generator=generator),
        torch.rand(NUM_DRAWS, dtype=torch.float64, generator=generator),
    )
    second = [out[1] for out in outputs if len(out) >= 2]
    assert len(second) > NUM_DRAWS // 3  # the first draft is accepted about 55% of the time
    statistic, dof = chi_square(second, p_next)
    assert statistic < CHI2_999[dof]


def test_the_chi_square_check_catches_a_correction_drawn_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has power: the classic bug, resampling from p instead of max(p - q, 0) at a
    rejection, emits min(p, q) + (1 - sum(min(p, q))) * p, and the statistic far exceeds the bound."""

    def from_p(p_final: torch.Tensor, *args: object) -> torch.Tensor:
        return p_final

    monkeypatch.setattr(rejection, "_correction_distribution", from_p)
    outputs = one_draft_per_request(P, Q, seed=0)
    statistic, dof = chi_square([out[0] for out in outputs], P)
    assert statistic > 10 * CHI2_999[dof]


def test_a_zero_probability_token_is_never_emitted() -> None:
    p = torch.tensor([0.4, 0.0, 0.3, 0.0, 0.2, 0.1])  # tokens 1 and 3 impossible
    q = torch.tensor([0.05, 0.4, 0.05, 0.4, 0.05, 0.05])  # ... and the draft's favourites
    outputs = one_draft_per_request(p, q, seed=4)
    emitted = [token for out in outputs for token in out]
    assert 1 not in emitted and 3 not in emitted
    statistic, dof = chi_square([out[0] for out in outputs], p)
    assert dof == 3 and statistic < 16.266  # chi2.ppf(0.999, 3)


def test_extreme_uniforms_never_draw_a_zero_probability_token() -> None:
    target_probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 2)  # [2 rows, vocab 5]
    uniforms = torch.tensor([0.0, 1.0 - 1e-16], dtype=torch.float64)
    assert rejection_sample(target_probs, [[], []], None, torch.zeros(0, dtype=torch.float64), uniforms) == [
        [1],
        [3],
    ]


def test_no_drafts_give_one_token_by_inverse_cdf_of_p() -> None:
    p = torch.tensor([0.5, 0.0, 0.5])  # cdf 0.5, 0.5, 1.0: the first token whose cdf exceeds u
    target_probs = p.repeat(3, 1)
    uniforms = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    out = rejection_sample(target_probs, [[], [], []], None, torch.zeros(0, dtype=torch.float64), uniforms)
    assert out == [[0], [2], [2]]


def test_all_drafts_accepted_give_k_plus_one_tokens() -> None:
    vocab = 5
    target_probs = torch.eye(vocab)[[2, 4, 1, 3]]  # rows: p one-hot at 2, 4, 1, then the bonus row at 3
    drafts = [[2, 4, 1]]
    accept = torch.tensor([0.999, 0.999, 0.999], dtype=torch.float64)  # p(d) = 1 accepts even so
    out = rejection_sample(target_probs, drafts, None, accept, torch.tensor([0.5], dtype=torch.float64))
    assert out == [[2, 4, 1, 3]]


def test_the_bonus_token_after_sampled_drafts_is_drawn_from_p_not_a_residual() -> None:
    target_probs = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])  # row 1: the bonus row
    draft_probs = torch.tensor([[0.6, 0.4, 0.0]])  # p(0) = 1 >= q(0): accepted
    accept = torch.tensor([0.999], dtype=torch.float64)
    out = rejection_sample(target_probs, [[0]], draft_probs, accept, torch.tensor([0.1], dtype=torch.float64))
    assert out == [[0, 0]]  # from p at u = 0.1; max(p - q, 0) = [0, 0.1, 0] would give token 1


def test_a_draft_the_target_cannot_emit_is_never_accepted() -> None:
    target_probs = torch.tensor([[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0]])  # the draft is sure of token 0; p(0) = 0
    accept = torch.tensor([0.0], dtype=torch.float64)  # the most accepting uniform
    out = rejection_sample(target_probs, [[0]], draft_probs, accept, torch.tensor([0.0], dtype=torch.float64))
    assert out == [[1]]  # rejected; the correction max(p - q, 0) = p here, and u = 0 picks token 1
    assert rejection_sample(target_probs, [[0]], None, accept, torch.tensor([0.0], dtype=torch.float64)) == [[1]]


def test_a_draft_with_zero_draft_probability_is_accepted_when_the_target_allows_it() -> None:
    target_probs = torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.0, 1.0]])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0]])  # q(1) = 0: p / q is infinite, min(1, .) = 1
    accept = torch.tensor([0.999], dtype=torch.float64)
    out = rejection_sample(target_probs, [[1]], draft_probs, accept, torch.tensor([0.5], dtype=torch.float64))
    assert out == [[1, 2]]


def test_a_draft_with_zero_target_and_zero_draft_probability_is_rejected() -> None:
    target_probs = torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.0, 1.0]])
    draft_probs = torch.tensor([[0.0, 1.0, 0.0]])  # q(0) = p(0) = 0: 0 / 0 must not accept
    accept = torch.tensor([0.0], dtype=torch.float64)
    out = rejection_sample(target_probs, [[0]], draft_probs, accept, torch.tensor([0.9], dtype=torch.float64))
    assert out == [[2]]  # max(p - q, 0) = [0, 0, 0.4]


def test_a_rejection_where_p_is_q_up_to_rounding_draws_from_p() -> None:
    target_probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.500001]])  # p <= q everywhere: max(p - q, 0) sums to 0
    accept = torch.tensor([0.9999999], dtype=torch.float64)  # u * q(1) > p(1): rejected
    out = rejection_sample(target_probs, [[1]], draft_probs, accept, torch.tensor([0.25], dtype=torch.float64))
    assert out == [[0]]  # from p: u = 0.25 picks token 0


def test_each_request_uses_its_own_rows_and_draft_distributions() -> None:
    """Three requests with k = 2, 0, 1 in one call: a row or q taken from the wrong request changes the
    result (a wrong q for a rejected draft leaves its p unchanged, and u = 0.1 then picks the draft)."""
    vocab = 6
    one_hot = torch.eye(vocab)
    target_probs = torch.stack(
        [
            one_hot[1],  # request 0, row 0: accepts draft 1
            torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),  # request 0, row 1: draft 2 rejected at u = 0.9
            one_hot[0],  # request 0, bonus row (unused)
            one_hot[0],  # request 1 (no drafts)
            torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5]),  # request 2, row 0: draft 4 rejected at u = 0.9
            one_hot[5],  # request 2, bonus row (unused)
        ]
    )
    draft_probs = one_hot[[1, 2, 4]]  # the drafts were sure of themselves
    accept = torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64)
    recover = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    out = rejection_sample(target_probs, [[1, 2], [], [4]], draft_probs, accept, recover)
    assert out == [[1, 3], [0], [5]]
    assert rejection_sample(target_probs, [[1, 2], [], [4]], None, accept, recover) == [[1, 3], [0], [5]]


def test_mismatched_shapes_are_rejected() -> None:
    target_probs = torch.full((3, 4), 0.25)
    uniforms = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(target_probs, [[1]], None, uniforms, uniforms)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(target_probs, [[1], []], torch.full((2, 4), 0.25), uniforms, torch.zeros(2))
    with pytest.raises(ValueError, match="recover_uniforms"):
        rejection_sample(target_probs, [[1], []], None, uniforms, uniforms)


def test_greedy_verify_accepts_drafts_while_they_match_the_argmax() -> None:
    # request 0: drafts 5 7 9 vs argmax 5 7 2 (9 mismatches) -> 5 7 2
    # request 1: no drafts -> the argmax 4
    # request 2: drafts 1 2 vs argmax 1 2, bonus argmax 8 -> 1 2 8
    # request 3: first draft mismatches -> the argmax 6
    argmax = [5, 7, 2, 0, 4, 1, 2, 8, 6, 3]
    drafts = [[5, 7, 9], [], [1, 2], [0]]
    assert greedy_verify(argmax, drafts) == [[5, 7, 2], [4], [1, 2, 8], [6]]


def test_greedy_verify_rejects_a_wrong_number_of_rows() -> None:
    with pytest.raises(ValueError, match="target_argmax"):
        greedy_verify([1, 2], [[1, 2]])
