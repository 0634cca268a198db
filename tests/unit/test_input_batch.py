"""The runner's step batch: the decode-only fast path builds what the general path builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.block_table import BlockTables
from tokenmill.worker.input_batch import RunnerRequestState, _decode_batch, _mixed_batch, build_step_batch
from tokenmill.worker.staging import Staging


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
        tables = BlockTables.of(cpu, [(s.req_id, s.block_ids) for s in states])
        fast, general = _decode_batch(states, 16, tables), _mixed_batch(states, [1] * len(states), 16, tables)
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


def test_block_tables_follow_added_extended_and_removed_requests() -> None:
    tables = BlockTables(Staging(torch.device("cpu")), num_rows=2, width=2)
    tables.add("a", [5, 6, 7])  # wider than the table: it widens
    tables.add("b", [1])
    tables.add("c", [9, 8])  # a third row: the table grows
    tables.extend("b", [2, 3])
    assert tables.host(["c", "a", "b"]).tolist() == [[9, 8, 0], [5, 6, 7], [1, 2, 3]]
    tables.remove("a")
    tables.add("d", [4])  # takes a's row: nothing of a's blocks shows
    assert tables.host(["d", "c"]).tolist() == [[4, 0], [9, 8]]
    assert tables.host(["d"]).dtype == np.int32


def test_the_runners_table_equals_one_made_from_the_states() -> None:
    """Blocks added step by step, requests ending and arriving, against a table made from the lists."""
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    tables = BlockTables(Staging(cpu))
    lists: dict[str, list[int]] = {}
    for step in range(200):
        if lists and rng.random() < 0.2:
            gone = str(rng.choice(sorted(lists)))
            del lists[gone]
            tables.remove(gone)
        if rng.random() < 0.3:
            lists[f"r{step}"] = rng.integers(0, 1000, int(rng.integers(1, 5))).tolist()
            tables.add(f"r{step}", lists[f"r{step}"])
        for req_id in lists:
            if rng.random() < 0.3:
                new = rng.integers(0, 1000, int(rng.integers(1, 3))).tolist()
                lists[req_id] += new
                tables.extend(req_id, new)
        if lists:
            order = [str(r) for r in rng.permutation(sorted(lists))]
            expected = BlockTables.of(cpu, [(r, lists[r]) for r in order]).host(order)
            assert np.array_equal(tables.host(order), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs CUDA")
def test_staging_copies_each_array_to_the_gpu() -> None:
    staging = Staging(torch.device("cuda"))
    for _ in range(3):
        staging.begin_step()
        arrays = [np.arange(n, dtype=dtype) for n, dtype in ((5, np.int32), (300_000, np.int64), (7, np.int64))]
        out = [staging.to_device(a) for a in arrays]
        for a, t in zip(arrays, out):
            assert t.is_cuda and t.cpu().numpy().tolist() == a.tolist()
