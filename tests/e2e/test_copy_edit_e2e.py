"""The `copy-edit` workload through the embedded model's tokenizer and chat template (SmolLM2, what
BENCHMARKS.md measures it on): sizes within the documented bounds, and answers that prompt lookup can
mostly propose. Then `bench throughput` on it with speculation on and off: the same greedy texts (by
their hashes), and the acceptance reported. The tasks themselves: tests/unit/test_copy_edit_workload.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server.conftest import make_chat_model
from tests.unit.test_copy_edit_workload import lookup_share
from tokenmill import LLM
from tokenmill.bench import make_workload, run_throughput
from tokenmill.bench.copy_edit import copy_edit_tasks
from tokenmill.cli import main
from tokenmill.loader.default_model import default_model_path

VOCAB = 49_152
# docs/benchmarking.md's row for copy-edit
PROMPT_TOKENS = (140, 400)
OUTPUT_TOKENS = (100, 256)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())  # first run converts (~25 s), then cached


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompts_and_outputs_are_within_the_documented_sizes(smollm2_tokenizer: Any, seed: int) -> None:
    requests = make_workload("copy-edit", VOCAB, seed=seed, num_requests=32, tokenizer=smollm2_tokenizer)
    for r in requests:
        assert PROMPT_TOKENS[0] <= len(r.prompt_token_ids) <= PROMPT_TOKENS[1]
        assert OUTPUT_TOKENS[0] <= r.output_len <= OUTPUT_TOKENS[1]


def test_prompt_lookup_could_propose_most_answer_tokens(smollm2_tokenizer: Any) -> None:
    shares = []
    for task in copy_edit_tasks(np.random.default_rng(0), 32):
        prompt = smollm2_tokenizer.encode(task.prompt, add_special_tokens=False)
        answer = smollm2_tokenizer.encode(task.answer, add_special_tokens=False)
        shares.append(lookup_share(prompt, answer))
    assert min(shares) >= 0.6 and float(np.mean(shares)) >= 0.8


# ---------------------------------------------------------------------- bench throughput, speculation on and off
# The tiny chat model (byte-level tokenizer, 512 positions): copy-edit capped to fit. One-token lookups,
# since its random greedy output repeats single tokens, rarely pairs.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
CAPS = {"num_requests": 4, "max_prompt_len": 160, "max_output_len": 24}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _llm(model: Path, **kwargs: Any) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=128, max_model_len=256, **kwargs)


def test_greedy_texts_match_with_speculation_on_and_off_and_acceptance_is_reported(chat_model: Path) -> None:
    off_llm, on_llm = _llm(chat_model), _llm(chat_model, speculative_config=NGRAM)
    requests = make_workload("copy-edit", VOCAB, tokenizer=off_llm.get_tokenizer(), **CAPS)
    off, on = run_throughput(off_llm, requests), run_throughput(on_llm, requests)
    assert on.output_text_sha256 == off.output_text_sha256 and on.outputs_sha256 == off.outputs_sha256
    assert not off.speculative and off.spec_num_draft_tokens == 0
    assert on.speculative and on.spec_num_drafts > 0
    assert 0 <= on.spec_num_accepted_tokens <= on.spec_num_draft_tokens
    assert on.acceptance_rate == on.spec_num_accepted_tokens / on.spec_num_draft_tokens
    assert on.mean_accepted_length == 1 + on.spec_num_accepted_tokens / on.spec_num_drafts  # vLLM's definition


def test_cli_bench_throughput_prints_and_writes_the_acceptance(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "spec.json"
    caps = ["--num-prompts", "2", "--max-prompt-len", "160", "--max-output-len", "16"]
    engine = ["--model", str(chat_model), "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "256"]
    spec = ["--speculative-config", json.dumps(NGRAM)]
    main(["bench", "throughput", "--workload", "copy-edit", *engine, *caps, *spec, "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert "acceptance rate" in printed and "mean accepted length" in printed and "outputs sha256" in printed
    report = json.loads(out.read_text())
    results = report["results"]
    assert results["speculative"] and 0.0 <= results["acceptance_rate"] <= 1.0
    assert results["mean_accepted_length"] >= 1.0
    assert len(results["output_text_sha256"]) == 2
    assert report["config"]["speculative_config"]["num_speculative_tokens"] == 3
