"""The second KV tier (--kv-offloading-size) end to end on a tiny Llama with a pool too small for the
workload: outputs equal the tier-less engine's, evicted prefixes come back from the tier (counted as
cached tokens), a restarted engine finds its file tier, a corrupt block is a miss, and salts stay apart."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 16
POOL_BLOCKS = 24  # 384 tokens: one 160-token prompt fits, the four together do not
PROMPTS = random_prompts(4, 160, 160, seed=49)


def make_llm(model: Path, tier: Path | None) -> LLM:
    extra = {} if tier is None else {"kv_offloading_size": 0.01, "kv_offloading_path": str(tier)}
    return LLM(str(model), dtype="float32", num_kv_blocks=POOL_BLOCKS, block_size=BLOCK, **extra)


def run_turns(llm: LLM, prompts: list[list[int]], salt: str | None = None) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order: (greedy tokens, cached prompt tokens) of each."""
    out = []
    for prompt in prompts:
        result = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)[0]
        assert result.metrics is not None
        out.append((list(result.outputs[0].token_ids), result.metrics.num_cached_tokens))
    return out


@pytest.fixture(scope="module")
def reference(llama_model: Path) -> list[list[int]]:
    """Greedy tokens of the workload without a tier (prompts 0-3, then 0 and 1 again)."""
    with make_llm(llama_model, None) as llm:
        return [tokens for tokens, _ in run_turns(llm, PROMPTS + PROMPTS[:2])]


def test_evicted_prefix_is_loaded_from_the_tier_with_equal_outputs(
    llama_model: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    with make_llm(llama_model, tmp_path) as llm:
        turns = run_turns(llm, PROMPTS + PROMPTS[:2])
        stats = llm.engine.kv_tier_stats
        assert stats is not None
        assert [t for t, _ in turns] == reference
        assert [c for _, c in turns[:4]] == [0, 0, 0, 0]
        # Prompts 0 and 1 were evicted from the 24-block pool by 2 and 3: their 9 full blocks (the 10th
        # holds the last token, always computed) come back from the tier.
        assert [c for _, c in turns[4:]] == [144, 144]
        assert stats.hit_tokens == 288 and stats.blocks_loaded == 18 and stats.load_failures == 0
        assert stats.blocks_saved > 0 and stats.bytes_read == 18 * llm.engine.runner.kv_tier.block_nbytes


def test_restarted_engine_finds_its_file_tier(llama_model: Path, reference: list[list[int]], tmp_path: Path) -> None:
    with make_llm(llama_model, tmp_path) as llm:
        run_turns(llm, PROMPTS)  # 0 and 1 evicted to the tier; shutdown finishes the writes
    with make_llm(llama_model, tmp_path) as llm:
        turns = run_turns(llm, PROMPTS[:2])
    assert [t for t, _ in turns] == reference[:2]
    assert [c for _, c in turns] == [144, 144]


def test_a_corrupt_tier_block_is_a_miss_with_a_warning(
    llama_model: Path, reference: list[list[int]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with make_llm(llama_model, tmp_path) as llm:
        run_turns(llm, PROMPTS)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for file in files:  # flip a byte in the middle of every stored block's payload
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING), make_llm(llama_model, tmp_path) as llm:
        turns = run_turns(llm, PROMPTS[:1])
        stats = llm.engine.kv_tier_stats
        assert stats is not None and stats.load_failures >= 1 and stats.blocks_loaded == 0
    assert turns[0] == (reference[0], 0)
    assert any("kvb" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_the_tier_never_serves_one_salt_to_another(llama_model: Path, tmp_path: Path) -> None:
    with make_llm(llama_model, tmp_path) as llm:
        run_turns(llm, PROMPTS, salt="key-a")
        other = run_turns(llm, PROMPTS[:1], salt="key-b")
        same = run_turns(llm, PROMPTS[1:2], salt="key-a")
    assert other[0][1] == 0
    assert same[0][1] == 144
