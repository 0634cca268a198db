"""The decode CUDA-graph runner: buckets and input padding (on CPU), and replay equal to the eager
forward (GPU only: needs CUDA and triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tests.tiny_models import TINY
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.cuda_graph import PAD_SLOT_ID, CudaGraphRunner, batch_size_buckets
from tokenmill.worker.input_batch import RunnerRequestState, StepBatch, build_step_batch

BLOCK_SIZE = 16


def decode_batch(context_lens: list[int], device: torch.device, first_block: int = 0) -> StepBatch:
    """One decode token per request, after context_lens tokens already in the cache (distinct blocks)."""
    states, next_block = [], first_block
    for i, n in enumerate(context_lens):
        n_blocks = n // BLOCK_SIZE + 1  # room for the new token too
        states.append(
            RunnerRequestState(
                req_id=f"r{i}",
                num_prompt_tokens=n,
                token_ids=[(7 * i + j) % 500 + 3 for j in range(n + 1)],
                sampling_params=SamplingParams(),
                block_ids=list(range(next_block, next_block + n_blocks)),
                num_computed_tokens=n,
            )
        )
        next_block += n_blocks
    return build_step_batch(states, [1] * len(states), BLOCK_SIZE, device)


def cpu_runner(max_num_seqs: int = 8) -> CudaGraphRunner:
    return CudaGraphRunner(
        nn.Identity(),
        max_num_seqs=max_num_seqs,
        max_model_len=128,
        block_size=BLOCK_SIZE,
        hidden_size=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_buckets_are_powers_of_two_then_multiples_of_32_up_to_max_num_seqs() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_prepare_copies_the_step_and_pads_to_the_bucket() -> None:
    runner = cpu_runner()
    batch = decode_batch([5, 40, 17], torch.device("cpu"))
    assert runner.prepare(batch) == 4
    meta = batch.attn_metadata
    assert runner.input_ids[:3].tolist() == batch.input_ids.tolist()
    assert runner.positions[:3].tolist() == [5, 40, 17]
    assert runner.slot_mapping[:4].tolist() == meta.slot_mapping.tolist() + [PAD_SLOT_ID]
    assert runner.seq_lens[:4].tolist() == [6, 41, 18, 1]
    width = meta.block_tables.shape[1]
    assert torch.equal(runner.block_tables[:3, :width], meta.block_tables)


def test_only_decode_batches_within_the_buffers_fit() -> None:
    runner = cpu_runner(max_num_seqs=4)
    cpu = torch.device("cpu")
    assert runner.fits(decode_batch([5, 40], cpu))
    assert not runner.fits(decode_batch([5] * 5, cpu))  # more requests than the largest bucket
    assert not runner.fits(decode_batch([200], cpu))  # context beyond max_model_len
    states = [RunnerRequestState("p", 8, list(range(8)), SamplingParams(), [0], 0)]
    assert not runner.fits(build_step_batch(states, [8], BLOCK_SIZE, cpu))  # a prompt
    assert not runner.can_run(decode_batch([5], cpu))  # nothing captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install -e '.[gpu]')")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_the_eager_forward(dtype: str) -> None:
    from transformers import AutoConfig

    from tokenmill.attention.triton.backend import TritonBackend
    from tokenmill.config import ModelConfig
    from tokenmill.models.llama import Attention
    from tokenmill.worker.model_loader import load_model

    cuda = torch.device("cuda")
    hf_config = AutoConfig.for_model("llama", **TINY)
    config = ModelConfig(model="tiny", hf_config=hf_config, dtype=dtype, max_model_len=256, load_format="dummy")
    model = load_model(config, None, TritonBackend(cuda), "cuda")
    torch_dtype = getattr(torch, dtype)
    caches = []
    for attn in (m for m in model.modules() if isinstance(m, Attention)):  # random "cached prefix" contents
        cache = torch.randn(2, 128, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, device=cuda).to(torch_dtype)
        attn.kv_cache = cache
        caches.append(cache)
    runner = CudaGraphRunner(
        model,
        max_num_seqs=8,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        hidden_size=hf_config.hidden_size,
        dtype=torch_dtype,
        device=cuda,
    )
    stats = runner.capture()
    assert stats.batch_sizes == [1, 2, 4, 8] and stats.seconds > 0

    atol = 1e-3 if dtype == "float32" else 3e-2
    # 3 requests replay the 4-row graph, 5 the 8-row one; the second step has longer contexts.
    for context_lens in ([5, 40, 17], [200, 1, 33, 64, 90]):
        batch = decode_batch(context_lens, cuda)
        assert runner.can_run(batch)
        before = [c.clone() for c in caches]
        with torch.inference_mode():
            eager = model(batch.input_ids, batch.positions, batch.attn_metadata).clone()
        after_eager = [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        with torch.inference_mode():  # as in ModelRunner.execute
            graphed = runner.run(batch).clone()
        torch.testing.assert_close(graphed, eager, atol=atol, rtol=atol)
        for cache, expected in zip(caches, after_eager):  # same slots written; padding rows wrote nothing
            torch.testing.assert_close(cache, expected, atol=0, rtol=0)
