"""Pipeline parallelism: the decoder layers split into stages over gloo processes give the same greedy
tokens (and logprobs, to rounding) as one process, with chunked prefill, preemption, steps in flight,
an uneven layer partition, and tensor parallelism inside each stage; a killed stage ends its requests
with an error instead of hanging. The reference is the same engine at pipeline_parallel_size 1."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_tensor_parallel import kill_rank_1_mid_run
from tests.tiny_models import make_tiny_model, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import RequestOutput

pytestmark = pytest.mark.timeout(240)  # a broken send or receive must fail the test, never hang CI

# Chunked prefill (prompts up to 70 tokens, 32 tokens per step) and preemption (10 blocks of 16 tokens
# cannot hold 6 requests of up to 90 tokens each).
TIGHT = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=10, max_num_seqs=6)
PROMPTS = random_prompts(6, 20, 70, seed=28)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)


IN_FLIGHT: list[int] = []  # steps in flight at each launch of the last pipelined engine


def _generate(folder: Path, **kwargs: Any) -> tuple[list[RequestOutput], int, int]:
    """(outputs, preemptions, rank 0's decoder layers) of one engine, shut down afterwards."""
    with LLM(str(folder), **kwargs) as llm:
        engine, launch = llm.engine, llm.engine.executor.launch
        IN_FLIGHT.clear()

        def counted(sched: Any) -> None:
            IN_FLIGHT.append(len(engine._in_flight))
            launch(sched)

        engine.executor.launch = counted  # type: ignore[method-assign]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return outputs, engine.scheduler.stats.num_preemptions, len(engine.runner.model.layers)


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_logprobs_close(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b):
        for pos_x, pos_y in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert pos_x.keys() == pos_y.keys()
            for token in pos_x:
                assert pos_x[token].logprob == pytest.approx(pos_y[token].logprob, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers, so that stages can hold unequal shares."""
    return make_tiny_model(tmp_path_factory.mktemp(f"pp-{request.param}"), request.param, num_hidden_layers=4)


def test_pp2_greedy_tokens_and_logprobs_equal_pp1_with_chunked_prefill_and_preemption(family_model: Path) -> None:
    one, _, _ = _generate(family_model, **TIGHT)
    two, preemptions, first_stage_layers = _generate(family_model, pipeline_parallel_size=2, **TIGHT)
    assert first_stage_layers == 2  # of 4: the first stage holds half
    assert preemptions > 0  # the tight cache really preempted (and recomputed) requests
    assert max(IN_FLIGHT) == 2  # a step was launched while another was in flight (virtual engines)
    assert _tokens(two) == _tokens(one)
    _assert_logprobs_close(two, one)


def test_an_uneven_partition_and_tp2_inside_each_stage_equal_pp1(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    kwargs: dict[str, Any] = dict(dtype="float32", num_kv_blocks=64)
    one, _, _ = _generate(folder, **kwargs)
    uneven, _, first_stage_layers = _generate(folder, pipeline_parallel_size=2, pp_layer_partition="1,3", **kwargs)
    assert first_stage_layers == 1
    assert _tokens(uneven) == _tokens(one)
    four_ranks, _, _ = _generate(folder, pipeline_parallel_size=2, tensor_parallel_size=2, **kwargs)
    assert _tokens(four_ranks) == _tokens(one)
    _assert_logprobs_close(four_ranks, one)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_parallel_size": 3}, "exceeds the model's 2 layers"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": "2,1"}, "sums to 3 layers; the model has 2"),
        ({"pipeline_parallel_size": 2, "pp_layer_partition": "2"}, "each of the 2 pipeline stages"),
        ({"pipeline_parallel_size": 2, "enable_lora": True}, "does not serve LoRA adapters"),
    ],
)
def test_what_pipeline_stages_cannot_do_is_a_clear_error(
    llama_model: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_model), dtype="float32", **options)


def test_a_killed_stage_ends_every_request_with_an_error_and_the_engine(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2)
    try:
        for output in kill_rank_1_mid_run(llm, PROMPTS[:3]):  # rank 1: the second stage
            assert output.outputs[0].finish_reason == "error"
            assert output.error is not None and "rank 1 exited with code -9" in output.error
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray: pip install 'tokenmill[ray]'")
def test_pp2_stages_on_two_ray_nodes_equal_pp1(tmp_path: Path) -> None:
    """A Ray cluster of a head without CPUs (the driver: stage 0) and two one-CPU worker nodes: the
    placement group's bundles land on the workers, so stage 1 runs on another node than stage 0 (nodes
    of one machine here, raylets of their own, as ray.cluster_utils builds them)."""
    import ray
    from ray.cluster_utils import Cluster

    folder = make_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    one, _, _ = _generate(folder, dtype="float32", num_kv_blocks=64)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        llm = LLM(
            str(folder), dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2, distributed_executor_backend="ray"
        )
        try:
            driver_node = ray.get_runtime_context().get_node_id()
            actor = llm.engine.executor.actors[0]  # type: ignore[attr-defined]
            assert ray.get(actor.node_id.remote()) != driver_node
            assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(one)
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
