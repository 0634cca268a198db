"""Prefill/decode disaggregation through a shared file tier (--kv-role): a prefill engine computes the
prompts and saves their blocks to the tier's folder as each request finishes; a decode engine on the
same folder loads them instead of computing them, and its greedy tokens equal one engine's. The transfer
is checked block by block: each block the decode engine loaded holds the bytes the prefill engine
computed for that prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams

BLOCK = 16
PROMPTS = random_prompts(4, 40, 100, seed=51)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1)


def _llm(model: Path, tier: Path | None, role: str = "both") -> LLM:
    extra: dict[str, Any] = {} if tier is None else {"kv_offloading_size": 0.01, "kv_offloading_path": str(tier)}
    return LLM(str(model), dtype="float32", num_kv_blocks=64, block_size=BLOCK, kv_role=role, **extra)


def _block_bytes(llm: LLM) -> dict[bytes, torch.Tensor]:
    """Each cached prefix block's KV (every layer's), by its hash."""
    io = llm.engine.runner.kv_tier
    assert io is not None
    return {bytes(h): io._gather(block.block_id) for h, block in llm.engine.kv_cache.pool.cached_blocks()}


def test_a_decode_engine_continues_from_the_prefill_engines_blocks(llama_model: Path, tmp_path: Path) -> None:
    with _llm(llama_model, None) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with _llm(llama_model, tmp_path, "prefill") as prefill, _llm(llama_model, tmp_path, "decode") as decode:
        prefill.generate(PROMPTS, PREFILL_ONLY, use_tqdm=False)
        computed = _block_bytes(prefill)
        outputs = decode.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        # Every full block before each prompt's last token came from the tier; only the rest was computed.
        full = [(len(p) - 1) // BLOCK for p in PROMPTS]
        assert [o.metrics.num_cached_tokens for o in outputs if o.metrics] == [n * BLOCK for n in full]
        stats = decode.engine.kv_tier_stats
        assert stats is not None and stats.blocks_loaded == sum(full) and stats.load_failures == 0
        loaded = _block_bytes(decode)
        shared = [h for h in computed if h in loaded]
        assert len(shared) >= sum(full)
        for block_hash in shared:
            assert torch.equal(loaded[block_hash], computed[block_hash]), block_hash.hex()


def test_a_decode_engine_without_the_prefill_computes_the_prompt(llama_model: Path, tmp_path: Path) -> None:
    with _llm(llama_model, None) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    with _llm(llama_model, tmp_path, "decode") as decode:
        outputs = decode.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert [o.metrics.num_cached_tokens for o in outputs if o.metrics] == [0, 0]


def test_a_kv_role_needs_the_file_tier(llama_model: Path) -> None:
    with pytest.raises(ValueError, match="give --kv-offloading-size"):
        _llm(llama_model, None, "prefill")
    with pytest.raises(ValueError, match="kv_role must be one of"):
        _llm(llama_model, None, "middle")
