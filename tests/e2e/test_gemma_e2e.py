"""Gemma 2 and 3 through the engine, beside the generic HF checks every family runs (test_hf_equivalence.py):
the window layers' KV group frees blocks as a request decodes, and int8 weights keep greedy agreement."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model, random_prompts, teacher_forced_top_tokens
from tokenmill import LLM, SamplingParams

WINDOW, BLOCK = 24, 16  # the tiny families' window


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_window_layers_hold_only_their_window_while_decoding(gemma: Path) -> None:
    llm = LLM(str(gemma), dtype="float32", num_kv_blocks=64, block_size=BLOCK, max_num_batched_tokens=32)
    kv = llm.engine.kv_cache
    assert [g.window for g in kv.window_groups] == [WINDOW]
    window = kv.window_groups[0]
    prompt = random_prompts(1, 200, 200, seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    held: list[tuple[int, int]] = []  # (group 0's blocks, the window group's) after each decode step
    for _ in llm.stream({"prompt_token_ids": prompt}, params):
        for req_id, blocks in kv.req_blocks.items():  # none after the last step: it freed them
            held.append((len(blocks), window.num_held_blocks(req_id)))
    assert len(held) == 39 and held[-1][0] == 15  # group 0 keeps every block: 238 tokens computed
    # The window group: the block of the newest token and those the window reaches back into.
    assert max(w for _, w in held[1:]) <= -(-(WINDOW - 1) // BLOCK) + 1
    assert window.pool.num_free_blocks == 64 and kv.pool.num_free_blocks == 64  # all back at the end


def test_int8_greedy_agreement_with_float32(gemma: Path) -> None:
    """Teacher-forced greedy tokens (one difference cannot snowball) of int8 weights against float32."""
    prompts = random_prompts(16, 10, 40, seed=0)

    fp32 = teacher_forced_top_tokens(LLM(str(gemma), dtype="float32", num_kv_blocks=64), prompts)
    int8 = teacher_forced_top_tokens(LLM(str(gemma), dtype="float32", num_kv_blocks=64, quantization="int8"), prompts)
    assert len(int8) == len(fp32) == sum(len(p) - 1 for p in prompts)
    assert sum(a == b for a, b in zip(int8, fp32)) / len(fp32) >= 0.95


def test_a_memory_sized_cache_gives_the_window_group_only_what_it_can_hold(gemma: Path) -> None:
    llm = LLM(str(gemma), dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4, max_num_batched_tokens=64)
    # The window group: 4 sequences x (2 blocks of window + 3) + 64 / 16 blocks of a step's tokens.
    assert llm.engine.kv_cache.window_groups[0].pool.num_blocks == 24
    # Group 0: the budget's rest, then capped as every model's (2 x max_num_seqs x blocks of max_model_len).
    assert llm.engine.kv_cache.pool.num_blocks == 2 * 4 * 512 // 16
    caches = [layer.self_attn.kv_cache for layer in llm.engine.runner.model.layers]
    assert [c.shape[1] if c is not None else 0 for c in caches] == [24, 256]  # local, global
    prompts = random_prompts(6, 20, 120, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(prompts, params, use_tqdm=False))
