"""A disaggregated fleet on a local Ray Serve instance: one prefill replica and one decode replica on one
KV tier folder (--prefill-replicas). A long prompt is computed by the prefill replica; the decode
replica loads its blocks (its usage counts them as cached on the prompt's first visit) and its greedy
answer equals one engine's, streamed or not. Short prompts skip the hop; bad input gets the server's
own error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, engine_args, free_port
from tests.server.test_fleet import metrics_after, sample
from tokenmill import LLM, SamplingParams

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tokenmill[ray]')")

from tokenmill.fleet.config import FleetConfig  # noqa: E402
from tokenmill.fleet.launcher import FleetRun  # noqa: E402
from tokenmill.server.config import ServerConfig  # noqa: E402

KEY = "sk-fleet-test"  # test_fleet's metrics helpers send it
BLOCK = 16
LONG = "Disaggregated serving moves the KV blocks of a prompt to another replica. "
HOPS = "tokenmill:router_prefill_hops_total"


@pytest.fixture(scope="module")
def fleet(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        tier = tmp_path_factory.mktemp("kv-tier")
        args = engine_args(chat_model, kv_offloading_size=0.01, kv_offloading_path=str(tier), block_size=BLOCK)
        config = ServerConfig(port=free_port(), served_model_name=MODEL_NAME, api_keys=(KEY,))
        fleet = FleetConfig(num_replicas=1, prefill_replicas=1, pd_min_prompt_tokens=8, routing_stats_period_s=0.5)
        run = FleetRun(args, config, fleet, log_to_driver=False)
        try:
            yield run.url
        finally:
            run.stop()


@pytest.fixture(scope="module")
def client(fleet: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{fleet}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _one_engine(model: Path, prompts: list[str]) -> list[str]:
    with LLM(str(model), dtype="float32", max_model_len=256, num_kv_blocks=64) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]


def test_a_long_prompt_is_prefilled_on_one_replica_and_decoded_on_the_other(
    client: openai.OpenAI, fleet: str, chat_model: Path
) -> None:
    prompts = [LONG + "First.", LONG + "Second one."]
    before = httpx.get(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    texts = []
    for prompt in prompts:
        reply = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        # The decode replica never saw this prompt: every full block before its last token was loaded.
        full = (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert full > 0 and reply.usage.prompt_tokens_details.cached_tokens == full
        texts.append(reply.choices[0].text)
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=LONG + "Third, streamed.",
        max_tokens=8,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts.append("".join(chunk.choices[0].text for chunk in streamed if chunk.choices))
    assert texts == _one_engine(chat_model, [*prompts, LONG + "Third, streamed."])
    after = metrics_after(fleet, before, "tokenmill:kv_tier_blocks_loaded_total", 3)
    assert sample(after, HOPS, outcome="prefilled") - sample(before, HOPS, outcome="prefilled") == 3
    assert sample(after, "tokenmill:kv_tier_blocks_loaded_total") > sample(
        before, "tokenmill:kv_tier_blocks_loaded_total"
    )


def test_a_short_prompt_goes_straight_to_the_decode_replica(client: openai.OpenAI, fleet: str) -> None:
    before = httpx.get(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    reply = client.completions.create(model=MODEL_NAME, prompt="Hi there.", max_tokens=4, temperature=0.0)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    after = httpx.get(f"{fleet}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert sample(after, HOPS, outcome="skipped") - sample(before, HOPS, outcome="skipped") == 1
    assert sample(after, HOPS, outcome="prefilled") == sample(before, HOPS, outcome="prefilled")


def test_bad_input_gets_the_servers_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=4, temperature=-1.0)
