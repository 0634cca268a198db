"""Speculative decoding emits exactly what sampling without it would: with temperature, top-k, top-p and
min-p all set, the tokens a draft model's sampled drafts leave after verification follow the
distribution the shared pipeline (tokenmill.sample.distribution) defines, the one the Sampler draws
from. The whole path runs: the draft model's pick (q), the verification rows' metadata, the Sampler,
the target's p and the rejection sampler. Checked by Pearson's chi-square test on seeded draws against
a reference computed by hand below, at the 99.9% level; a target that drifts from the sampler's
(min-p without renormalizing) fails the same test."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch

from tokenmill.sample.distribution import filtered_probs, sampling_probs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_model import DraftLM, DraftModelProposer
from tokenmill.worker import spec_verify
from tokenmill.worker.input_batch import RunnerRequestState

CPU = torch.device("cpu")
NUM_REQUESTS = 30_000
# 99.9% quantile of the chi-square distribution with 4 degrees of freedom (the reference's 5 tokens - 1;
# scipy.stats.chi2.ppf(0.999, 4), any chi-square table).
CHI2_4_DOF_999 = 18.467
PARAMS = SamplingParams(temperature=0.8, top_k=8, top_p=0.97, min_p=0.15, max_tokens=16)
TARGET = [2.0, 1.6, 1.3, 1.0, 0.7, 0.3, 0.0, -0.4, -0.9, -1.5, -2.0, -3.0]
# A draft that disagrees: it favours tokens 2, 4 and 6, and proposes 5 to 7, which the target's filters drop.
DRAFT = [0.5, 1.0, 1.5, 0.2, 1.2, 0.9, 1.1, 0.4, 0.0, -0.5, -1.0, -1.0]


def reference(logits: list[float], params: SamplingParams) -> list[float]:
    """softmax(logits / temperature); keep the top_k most likely; keep the most likely of those while the
    (renormalized) mass before each is below top_p; keep those at least min_p times the most likely;
    renormalize."""
    weights = [math.exp(x / params.temperature) for x in logits]
    kept = sorted(range(len(logits)), key=lambda i: -weights[i])[: params.top_k]
    total = sum(weights[i] for i in kept)
    nucleus: list[int] = []
    mass = 0.0
    for i in kept:
        if mass >= params.top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    top = max(weights[i] for i in nucleus)
    final = [i for i in nucleus if weights[i] >= params.min_p * top]
    total = sum(weights[i] for i in final)
    return [weights[i] / total if i in final else 0.0 for i in range(len(logits))]


P_REF = torch.tensor(reference(TARGET, PARAMS), dtype=torch.float64)
Q_REF = torch.tensor(reference(DRAFT, PARAMS), dtype=torch.float64)


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of the tokens' counts against probs; infinite when a token probs cannot
    emit appears."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).to(torch.float64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf
    expected = probs[support] * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum())


def metadata(n: int) -> SamplingMetadata:
    return SamplingMetadata.build([PARAMS] * n, [[0]] * n, [[]] * n, [None] * n, [], len(TARGET), CPU)


def speculative_first_tokens(seed: int) -> tuple[list[int], float]:
    """NUM_REQUESTS requests, each verifying one draft the draft model sampled: the first token each
    emits, and the fraction of drafts accepted."""
    torch.manual_seed(seed)
    proposer = DraftModelProposer(cast(DraftLM, None), None, block_size=16, device=CPU)
    drafts: list[list[int]] = [[] for _ in range(NUM_REQUESTS)]
    probs: list[list[torch.Tensor]] = [[] for _ in range(NUM_REQUESTS)]
    everyone = list(range(NUM_REQUESTS))
    draft_logits = torch.tensor(DRAFT).repeat(NUM_REQUESTS, 1)  # [NUM_REQUESTS, vocab]
    proposer._pick(draft_logits, everyone, 0, [[0]] * NUM_REQUESTS, [PARAMS] * NUM_REQUESTS, drafts, probs)
    states = [
        RunnerRequestState(f"r{i}", 1, [0], PARAMS, [0], 1, draft_probs=torch.stack(probs[i]))
        for i in range(NUM_REQUESTS)
    ]
    meta = spec_verify.verify_metadata(states, drafts, lambda state, j: None, [], len(TARGET), CPU)
    logits = torch.tensor(TARGET).repeat(2 * NUM_REQUESTS, 1)  # [2 * NUM_REQUESTS, vocab]: a draft row, a bonus row
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    emitted = spec_verify.accepted_tokens(sampled, states, drafts, logits, meta, None)
    accepted = sum(len(tokens) == 2 for tokens in emitted) / NUM_REQUESTS
    return [tokens[0] for tokens in emitted], accepted


def test_the_shared_pipeline_gives_the_hand_computed_distribution() -> None:
    assert (P_REF > 0).sum() == 5  # each filter drops tokens: top-k 12 -> 8, top-p -> 7, min-p -> 5
    p = sampling_probs(torch.tensor([TARGET]), metadata(1))[0]
    torch.testing.assert_close(p.double(), P_REF, rtol=0, atol=1e-6)
    q = filtered_probs(torch.tensor([DRAFT]), metadata(1))[0]
    torch.testing.assert_close(q.double(), Q_REF, rtol=0, atol=1e-6)


def test_the_sampler_draws_from_the_shared_pipeline() -> None:
    torch.manual_seed(0)
    sampled = Sampler()(torch.tensor(TARGET).repeat(NUM_REQUESTS, 1), metadata(NUM_REQUESTS)).sampled_token_ids
    assert chi_square(sampled.tolist(), P_REF) < CHI2_4_DOF_999


def test_speculative_decoding_emits_the_shared_pipelines_distribution() -> None:
    """The first emitted token follows p whatever the draft proposed, and a draft is kept with
    probability sum(min(p, q)) (0.50 here): the verifier weighs each draft with the q it came from."""
    first, accepted = speculative_first_tokens(seed=1)
    assert chi_square(first, P_REF) < CHI2_4_DOF_999
    expected = float(torch.minimum(P_REF, Q_REF).sum())
    assert abs(accepted - expected) < 5 * math.sqrt(expected * (1 - expected) / NUM_REQUESTS)


def test_a_target_that_drifts_from_the_sampler_fails_the_chi_square_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test has power: a target whose min-p does not renormalize (p sums to 0.93) skews the output
    (expected statistic about 70 at this sample size) and the same check rejects it."""
    nucleus = reference(TARGET, SamplingParams(temperature=0.8, top_k=8, top_p=0.97))  # no min-p
    kept_mass = sum(x for x, kept in zip(nucleus, P_REF > 0) if kept)

    def unnormalized(logits: torch.Tensor, meta: SamplingMetadata, bitmask: object = None) -> torch.Tensor:
        return sampling_probs(logits, meta) * kept_mass  # min-p's mask without its renormalization

    monkeypatch.setattr(spec_verify, "sampling_probs", unnormalized)
    first, _ = speculative_first_tokens(seed=1)
    assert chi_square(first, P_REF) > 2 * CHI2_4_DOF_999
