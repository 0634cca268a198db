"""Speculative decoding's verification in the model runner: the sampling rows of a step that verifies
drafts, and the tokens each request keeps.

A request verifying k drafts samples k + 1 rows, row j as if its output already held drafts[:j]
(penalties, min_tokens and the seed of its position follow), each drawn exactly as the sampler draws
without speculation. Drafts that are guesses without a distribution (n-gram lookup, a greedy draft)
are kept while each equals its row's sample, and the first sample that differs is emitted (or, with
every draft kept, the last row's: the bonus token). That is rejection sampling with a one-hot proposal
q: a draft is kept with probability p(draft) = min(1, p/q), and the sample that replaces a rejected one
follows p given that it is not the draft, i.e. the normalized max(p - q, 0); and greedy and seeded
outputs equal those without speculation. Drafts a draft model sampled from a distribution q go
through the rejection sampler (sample/rejection.py) against the rows' distributions p."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.sample.bitmask import TokenBitmask
from tokenmill.sample.distribution import sampling_probs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.rejection import greedy_verify, rejection_sample
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import RunnerRequestState

# A rejection-sampled request's uniforms come from their own stream (not its rows' sampling draws).
_REJECTION_SALT = 0x0E1EC7


def verify_metadata(
    states: list[RunnerRequestState],
    drafts: list[list[int]],
    row_generator: Callable[[RunnerRequestState, int], torch.Generator | None],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Sampling tensors with one row per verified position: request i's rows 0..len(drafts[i])."""
    params: list[SamplingParams] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    generators: list[torch.Generator | None] = []
    for state, draft in zip(states, drafts):
        prompt = state.token_ids[: state.num_prompt_tokens]
        output_ids = state.output_token_ids
        for j in range(len(draft) + 1):
            params.append(state.sampling_params)
            prompts.append(prompt)
            outputs.append(output_ids + draft[:j])
            generators.append(row_generator(state, j))
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        generators=generators,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        device=device,
    )


def accepted_tokens(
    sampled: list[int],  # one token per row, as the sampler drew them
    states: list[RunnerRequestState],
    drafts: list[list[int]],
    logits: torch.Tensor,  # [num_rows, vocab]
    meta: SamplingMetadata,
    bitmask: TokenBitmask | None,
) -> list[list[int]]:
    """Per request: its kept drafts, then one token of the target's."""
    tokens = greedy_verify(sampled, drafts)
    with_q = [i for i, state in enumerate(states) if drafts[i] and state.draft_probs is not None]
    if not with_q:
        return tokens
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + len(draft) + 1)
    rows = [r for i in with_q for r in range(starts[i], starts[i + 1])]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    # The rows' distributions, processed as the sampler processes them.
    p = sampling_probs(logits, meta, bitmask)[index]  # [len(rows), vocab]
    q_rows: list[torch.Tensor] = []
    accept: list[torch.Tensor] = []
    recover: list[torch.Tensor] = []
    for i in with_q:
        state, k = states[i], len(drafts[i])
        assert state.draft_probs is not None
        q_rows.append(state.draft_probs[:k])
        generator = None
        if state.generator is not None:
            generator = torch.Generator(logits.device)
            generator.manual_seed(state.position_seed(0, _REJECTION_SALT))
        uniforms = torch.rand(k + 1, dtype=torch.float64, generator=generator, device=logits.device)
        accept.append(uniforms[:k])
        recover.append(uniforms[k:])
    verified = rejection_sample(
        p, [drafts[i] for i in with_q], torch.cat(q_rows), torch.cat(accept), torch.cat(recover)
    )
    for i, kept in zip(with_q, verified):
        tokens[i] = kept
    return tokens
