"""Tensor parallelism's configuration: `LLM(..., tensor_parallel_size=N)` and `--tensor-parallel-size N`
(with `--distributed-executor-backend mp|ray`) reach EngineConfig.parallel; a size the model's heads do
not split into is a ValueError naming the sizes that work, at start-up."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from tokenmill.config import EngineArgs, ParallelConfig, SpeculativeConfig
from tokenmill.engine.engine_args import add_engine_args, create_engine_config, engine_kwargs, resolve_parallel

PRESET = {"model": "smollm2-135m", "load_format": "dummy"}  # 9 query heads, 3 KV heads; no files


def heads(num_heads: int, num_kv_heads: int, intermediate: int = 128) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate
    )


def test_the_default_is_one_rank_in_local_processes() -> None:
    config, _ = create_engine_config(EngineArgs(**PRESET))
    assert config.parallel == ParallelConfig(1, "mp")


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_size_that_is_not_a_positive_integer_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelConfig(tensor_parallel_size=size)  # type: ignore[arg-type]


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown distributed_executor_backend 'mpi'"):
        ParallelConfig(2, "mpi")


def test_the_size_must_divide_the_query_heads_and_the_error_lists_the_sizes_that_do() -> None:
    with pytest.raises(ValueError, match=r"must divide the model's 9 attention heads; use one of \[1, 3, 9\]"):
        create_engine_config(EngineArgs(**PRESET, tensor_parallel_size=2))
    config, _ = create_engine_config(EngineArgs(**PRESET, tensor_parallel_size=3))
    assert config.parallel.tensor_parallel_size == 3


def test_more_ranks_than_kv_heads_needs_a_multiple_of_the_kv_heads() -> None:
    ParallelConfig(4).check_model(heads(8, 2))  # each KV head copied to 2 ranks
    with pytest.raises(ValueError, match="must then be a multiple of 4"):
        ParallelConfig(6).check_model(heads(12, 4, intermediate=132))  # 6 ranks cannot share 4 KV heads evenly


def test_fewer_ranks_than_kv_heads_must_divide_them() -> None:
    with pytest.raises(ValueError, match="must divide the model's 3 KV heads"):
        ParallelConfig(2).check_model(heads(6, 3))


def test_the_mlp_width_must_split_evenly() -> None:
    with pytest.raises(ValueError, match="intermediate size 130"):
        ParallelConfig(4).check_model(heads(8, 4, intermediate=130))


def test_a_draft_model_is_refused_under_tensor_parallelism_and_ngram_is_kept() -> None:
    args = EngineArgs(tensor_parallel_size=2)
    draft = SpeculativeConfig("draft_model", 2, model="smollm2-135m")
    with pytest.raises(ValueError, match="draft model is not supported with tensor_parallel_size > 1"):
        resolve_parallel(args, heads(4, 2), draft)
    assert resolve_parallel(args, heads(4, 2), SpeculativeConfig("ngram", 2)).tensor_parallel_size == 2


def test_the_flags_reach_the_engine_args() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--tensor-parallel-size", "3", "--distributed-executor-backend", "ray"]))
    assert (kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"]) == (3, "ray")
    with pytest.raises(SystemExit):  # argparse: not a choice
        parser.parse_args(["--distributed-executor-backend", "slurm"])


def _layers(num_layers: int) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=num_layers)


def test_pipeline_stages_split_the_layers() -> None:
    assert ParallelConfig(pipeline_parallel_size=2).stage_layers(_layers(24)) == [(0, 12), (12, 24)]
    assert ParallelConfig(pipeline_parallel_size=3).stage_layers(_layers(5)) == [(0, 2), (2, 4), (4, 5)]
    explicit = ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(3, 1))
    assert explicit.stage_layers(_layers(4)) == [(0, 3), (3, 4)]
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    with pytest.raises(ValueError, match="sums to 5 layers; the model has 4"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(3, 2)).stage_layers(_layers(4))
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        ParallelConfig(pipeline_parallel_size=3).stage_layers(_layers(2))
    with pytest.raises(ValueError, match="at least one layer"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(4, 0))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
