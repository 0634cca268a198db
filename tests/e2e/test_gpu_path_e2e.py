"""The GPU path's wiring through engines on the tiny llama: --enforce-eager and --gpu-memory-utilization
reach the engine config, KV blocks sized from profiled peak memory, decode steps dispatched to the CUDA
graphs, and the CPU path left as it was. Tests that need a GPU are skipped without one. The arithmetic
alone: tests/unit/test_gpu_path.py."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine import engine_core
from tokenmill.engine.engine_args import add_engine_args, create_engine_config, engine_kwargs
from tokenmill.engine.engine_core import num_kv_blocks
from tokenmill.kv_groups import KVGroupSpec
from tokenmill.worker.input_batch import StepBatch
from tokenmill.worker.model_runner import kv_cache_bytes_per_block

GIB = 2**30
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 14, 3], [7, 7, 8, 100, 42, 11, 6, 2, 90]]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (pip install -e '.[gpu]')"
)


def parse_engine_args(argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs(parser.parse_args(argv))


# ------------------------------------------------------------------ flags and config
def test_enforce_eager_and_gpu_memory_utilization_flow_from_the_cli_to_the_engine_config(llama_model: Path) -> None:
    kwargs = parse_engine_args(["--enforce-eager", "--gpu-memory-utilization", "0.5"])
    assert kwargs["enforce_eager"] is True and kwargs["gpu_memory_utilization"] == 0.5
    config, _ = create_engine_config(EngineArgs(model=str(llama_model), **kwargs))  # type: ignore[arg-type]
    assert config.enforce_eager is True
    assert config.cache.gpu_memory_utilization == 0.5


def test_by_default_graphs_are_allowed_with_90_percent_of_the_gpu(llama_model: Path) -> None:
    kwargs = parse_engine_args([])
    config, _ = create_engine_config(EngineArgs(model=str(llama_model), **kwargs))  # type: ignore[arg-type]
    assert config.enforce_eager is False
    assert config.cache.gpu_memory_utilization == 0.9


def test_llm_accepts_enforce_eager(llama_model: Path) -> None:
    llm = LLM(model=str(llama_model), enforce_eager=True, num_kv_blocks=64)
    assert llm.config.enforce_eager is True
    assert llm.engine.runner.cuda_graphs is None


# ------------------------------------------------------------------ KV cache sizing
def test_on_cuda_the_profiled_budget_sizes_the_cache_within_the_per_sequence_cap(
    llama_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = create_engine_config(EngineArgs(model=str(llama_model), max_num_seqs=4, max_model_len=256))
    per_block = kv_cache_bytes_per_block(config)
    one_group = SimpleNamespace(kv_groups=KVGroupSpec.of_layers([None]))  # no window layers
    cuda_runner = SimpleNamespace(
        device=torch.device("cuda"), kv_cache_bytes_per_block=lambda: per_block, driver=one_group
    )
    # 0.9 of 1000 blocks' worth, less a peak of 800 blocks' worth: room for 100.
    monkeypatch.setattr(engine_core, "profile_peak_memory", lambda runner: (1000 * per_block, 800 * per_block))
    assert num_kv_blocks(config, cuda_runner) == 100  # type: ignore[arg-type]
    # Room for more than 2 * max_num_seqs full-length sequences: capped there, as on CPU.
    monkeypatch.setattr(engine_core, "profile_peak_memory", lambda runner: (10**6 * per_block, per_block))
    assert num_kv_blocks(config, cuda_runner) == 2 * 4 * (256 // 16)  # type: ignore[arg-type]


def test_on_cpu_the_cache_is_still_sized_by_kv_cache_memory_gb(
    llama_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_profiling(runner: object) -> tuple[int, int]:
        raise AssertionError("CPU engines do not profile")

    monkeypatch.setattr(engine_core, "profile_peak_memory", no_profiling)
    config, _ = create_engine_config(EngineArgs(model=str(llama_model), dtype="float32"))
    per_block = kv_cache_bytes_per_block(config)  # 2 * 2 layers * 2 heads * 16 dims * 4 bytes * 16 = 8 KiB
    assert per_block == 8 * 1024
    llm = LLM(model=str(llama_model), dtype="float32", kv_cache_memory_gb=37 * per_block / GIB)
    assert llm.engine.num_blocks == 37


def test_profile_run_steps_max_num_batched_tokens_then_unbinds_its_scratch_cache(llama_model: Path) -> None:
    llm = LLM(model=str(llama_model), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=300)
    runner = llm.engine.runner
    seen: list[int] = []
    logits_rows: list[int] = []
    forward, compute_logits = runner.model.forward, runner.model.compute_logits
    runner.model.forward = lambda ids, *rest: (seen.append(ids.shape[0]), forward(ids, *rest))[1]
    runner.model.compute_logits = lambda h: (logits_rows.append(h.shape[0]), compute_logits(h))[1]
    runner.profile_run()
    assert seen == [300]  # one step of the whole token budget ...
    assert logits_rows == [4]  # ... over max_num_seqs prompts, each sampled
    assert runner.kv_caches == []
    assert all(layer.self_attn.kv_cache is None for layer in runner.model.layers)


# ------------------------------------------------------------------ CUDA graphs, on CPU
def test_capturing_cuda_graphs_is_a_no_op_on_cpu(llama_model: Path) -> None:
    llm = LLM(model=str(llama_model), num_kv_blocks=64)  # enforce_eager is off
    runner = llm.engine.runner
    runner.capture_cuda_graphs()
    assert runner.cuda_graphs is None and runner.cuda_graph_capture_s is None
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


class ReplayRecorder:
    """Stands in for CudaGraphRunner: takes the decode steps, answers them with the eager forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.replayed: list[int] = []

    def can_run(self, batch: StepBatch) -> bool:
        return batch.attn_metadata.is_all_decode

    def run(self, batch: StepBatch) -> torch.Tensor:
        self.replayed.append(batch.attn_metadata.num_reqs)
        return self.model(batch.input_ids, batch.positions, batch.attn_metadata)


def test_decode_steps_that_a_graph_can_run_go_to_the_graphs_and_the_rest_run_eagerly(llama_model: Path) -> None:
    eager = LLM(model=str(llama_model), num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(model=str(llama_model), num_kv_blocks=64)
    recorder = ReplayRecorder(llm.engine.runner.model)
    llm.engine.runner.cuda_graphs = recorder  # type: ignore[assignment]
    graphed = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert recorder.replayed == [2] * 7  # the prompt step ran eagerly; the 7 decode steps did not
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


# ------------------------------------------------------------------ on a GPU
@needs_cuda
@needs_triton
def test_cuda_engine_captures_graphs_and_generates_what_the_eager_engine_does(llama_model: Path) -> None:
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8)
    eager = LLM(model=str(llama_model), enforce_eager=True, **kwargs)  # type: ignore[arg-type]
    assert eager.engine.runner.cuda_graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del eager
    llm = LLM(model=str(llama_model), **kwargs)  # type: ignore[arg-type]
    runner = llm.engine.runner
    assert runner.backend.name == "triton"
    assert runner.cuda_graphs is not None and runner.cuda_graph_capture_s and runner.cuda_graph_capture_s > 0
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


@needs_cuda
@needs_triton
def test_cuda_async_scheduling_generates_what_the_synchronous_engine_does(llama_model: Path) -> None:
    """On by default on CUDA: steps overlap (one in flight at each launch after the first), and greedy,
    seeded, top-p and logprob outputs equal those of the engine that collects every step first."""
    params = [
        GREEDY,
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, top_p=0.9, logprobs=2, ignore_eos=True),
    ]
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8)
    sync = LLM(model=str(llama_model), async_scheduling="off", **kwargs)  # type: ignore[arg-type]
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    del sync
    llm = LLM(model=str(llama_model), **kwargs)  # type: ignore[arg-type]
    assert llm.config.scheduler.async_scheduling
    in_flight: list[int] = []
    engine, launch = llm.engine, llm.engine.executor.launch
    engine.executor.launch = lambda sched: (in_flight.append(len(engine._in_flight)), launch(sched))[1]  # type: ignore[method-assign]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert max(in_flight) == 1
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert pos_a.keys() == pos_b.keys()


@needs_cuda
def test_cuda_kv_cache_fits_the_utilization_share_of_the_gpu(llama_model: Path) -> None:
    # max_num_seqs so large that the per-sequence cap (2 * max_num_seqs full-length sequences) stays out of reach.
    llm = LLM(
        model=str(llama_model),
        device="cuda",
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_num_seqs=2**17,
    )
    _, total = torch.cuda.mem_get_info()
    cache_bytes = sum(c.numel() * c.element_size() for c in llm.engine.runner.kv_caches)
    assert llm.engine.num_blocks > 1000
    assert torch.cuda.memory_allocated() <= 0.3 * total
    assert cache_bytes > 0.2 * total  # the tiny model leaves most of the share to the cache


def test_warm_up_lengths_meet_every_prefill_tile_size() -> None:
    from tokenmill.attention.triton.prefill import default_prefill_tiles
    from tokenmill.worker.model_runner import warm_up_query_lens

    for budget in (1, 7, 256, 2048):
        lens = warm_up_query_lens(budget)
        assert max(lens) == budget and all(1 <= n <= budget for n in lens)
        for head_dim, group in ((64, 1), (128, 4), (256, 8)):
            warmed = {default_prefill_tiles(head_dim, group, n) for n in lens}
            every = {default_prefill_tiles(head_dim, group, n) for n in range(2, budget + 1)}
            assert every <= warmed, (budget, head_dim, group)


def test_warm_up_runs_a_step_per_length_and_leaves_the_engine_serving(llama_model: Path) -> None:
    with LLM(str(llama_model), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=64) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        before = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        steps: list[int] = []
        runner = llm.engine.runner
        model_forward = runner.model.forward
        runner.model.forward = lambda ids, *a: (steps.append(ids.numel()), model_forward(ids, *a))[1]  # type: ignore[method-assign]
        runner.warm_up()
        assert steps == [1 + n for n in (2, 4, 8, 16, 32, 63)]  # a decode row + each length
        runner.model.forward = model_forward  # type: ignore[method-assign]
        assert llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids == before
