"""The runner's step batch: the decode-only fast path builds what the general path builds."""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import RunnerRequestState, _decode_batch, _mixed_batch, build_step_batch


def decoding(context_lens: list[int], block_size: int) -> list[RunnerRequestState]:
    """Requests that feed their last token after context_lens tokens in the cache, blocks out of order."""
    states, next_block = [], 100
    for i, n in enumerate(context_lens):
        blocks = n // block_size + 1
        states.append(
            RunnerRequestState(
                req_id=f"r{i}",
                num_prompt_tokens=max(1, n - 3),
                token_ids=[(11 * i + j) % 97 for j in range(n + 1)],
                sampling_params=SamplingParams(),
                block_ids=[next_block - 7 * b for b in range(blocks)],
                num_computed_tokens=n,
            )
        )
        next_block += 3 * blocks
    return states


def test_the_decode_batch_equals_the_general_one() -> None:
    cpu = torch.device("cpu")
    for context_lens in ([0], [15], [16, 3, 47, 31], list(range(1, 70, 5))):
        states = decoding(context_lens, 16)
        fast, general = _decode_batch(states, 16, cpu), _mixed_batch(states, [1] * len(states), 16, cpu)
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert fast.req_ids == general.req_ids and fast.sample_req_ids == general.sample_req_ids
        assert fast.prompt_logprob_rows == general.prompt_logprob_rows == {}
        a, b = fast.attn_metadata, general.attn_metadata
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        for name in ("query_start_loc_cpu", "seq_lens_cpu", "max_query_len", "max_seq_len"):
            assert getattr(a, name) == getattr(b, name), name


def test_a_step_with_a_prompt_chunk_takes_the_general_path() -> None:
    cpu = torch.device("cpu")
    states = decoding([20, 5], 16)
    prompt = RunnerRequestState("p", 8, list(range(8)), SamplingParams(), [3], 0)
    batch = build_step_batch([*states, prompt], [1, 1, 8], 16, cpu)
    assert batch.input_ids.shape == (10,) and batch.attn_metadata.max_query_len == 8
    assert batch.positions.tolist() == [20, 5, *range(8)]
