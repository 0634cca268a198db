"""The GPU path without an engine: --gpu-memory-utilization's range, KV blocks sized from profiled peak
memory (the arithmetic, on CPU), and a sampling step without host syncs (needs a GPU: skipped without
one). The wiring through engines on the tiny llama: tests/e2e/test_gpu_path_e2e.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.config import CacheConfig
from tokenmill.engine.engine_core import profiled_num_kv_blocks

GIB = 2**30
MIB = 2**20

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_outside_0_1_is_a_value_error(utilization: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=utilization)


# ------------------------------------------------------------------ KV cache sizing
def test_profiled_blocks_fill_the_utilization_share_left_after_the_peak() -> None:
    # An 80 GiB GPU at 0.9 allows 72 GiB; weights + largest step peak at 10 GiB: 62 GiB for the cache.
    # Qwen3-0.6B in bf16: 2 (k, v) * 28 layers * 8 KV heads * 128 dims * 2 bytes * 16 tokens = 1.75 MiB.
    per_block = 2 * 28 * 8 * 128 * 2 * 16
    assert per_block == 1.75 * MIB
    assert profiled_num_kv_blocks(80 * GIB, 10 * GIB, 0.9, per_block) == 36278  # 62 GiB / 1.75 MiB = 36278.9


def test_profiled_blocks_round_down_to_whole_blocks() -> None:
    assert profiled_num_kv_blocks(total_bytes=1000, peak_bytes=100, utilization=0.5, per_block_bytes=100) == 4
    assert profiled_num_kv_blocks(total_bytes=1000, peak_bytes=100, utilization=0.5, per_block_bytes=399) == 1


@pytest.mark.parametrize("peak_gib", [71.999, 72, 75])
def test_a_budget_without_one_block_is_a_value_error_that_says_what_to_change(peak_gib: float) -> None:
    with pytest.raises(ValueError, match="no room for the KV cache") as info:
        profiled_num_kv_blocks(80 * GIB, int(peak_gib * GIB), 0.9, 2 * MIB)
    assert "--gpu-memory-utilization" in str(info.value)
    assert "--max-num-batched-tokens" in str(info.value)


# ------------------------------------------------------------------ on a GPU
@needs_cuda
def test_sampling_a_step_adds_no_host_sync_on_cuda() -> None:
    from tokenmill.sample.metadata import SamplingMetadata
    from tokenmill.sample.sampler import Sampler

    cuda = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={3: 2.0},
            min_tokens=4,
            logprobs=2,
        ),
    ]
    generators = [None, torch.Generator(cuda).manual_seed(7), None]
    logits = torch.randn(3, 512, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = SamplingMetadata.build(params, [[1, 2, 3]] * 3, [[4, 5]] * 3, generators, [2], 512, cuda)
        out = Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (3,)
