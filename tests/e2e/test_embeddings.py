"""Pooling requests (embeddings, classification) against HF transformers on tiny random models: the pooled
final hidden state equals HF's, in prefill chunks shared with a generating request whose greedy tokens
stay HF's, and no KV block stays held afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import TINY, hf_greedy, hf_model, make_tiny_tokenizer, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.input_processor import PreparedRequest

NUM_BLOCKS = 256


def engine(folder: Path, **kwargs: object) -> LLM:
    # 32 tokens a step: the longer prompts are prefilled in chunks, beside the generating request's decodes.
    defaults: dict[str, object] = dict(dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=16)
    return LLM(str(folder), **(defaults | dict(max_num_batched_tokens=32) | kwargs))


@torch.inference_mode()
def hf_hidden(folder: Path, prompt: list[int]) -> torch.Tensor:
    """HF's last hidden state (after the final norm) of every prompt position: [len(prompt), hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    return model(torch.tensor([prompt])).last_hidden_state[0]


def test_embeddings_equal_hf_last_token_while_a_request_generates(llama_model: Path) -> None:
    llm = engine(llama_model)
    prompts = random_prompts(5, 3, 90, seed=7)
    generating = random_prompts(1, 20, 20, seed=8)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    params = llm.pooling.params("embed")
    prepared: list[PreparedRequest] = [llm.inputs.process("gen", generating, greedy)]
    prepared += [llm.inputs.process_pooling(f"emb{i}", p, params) for i, p in enumerate(prompts)]
    results = llm._run(prepared, use_tqdm=False)  # one engine: the prefills share steps with the decodes

    assert results[0].outputs[0].token_ids == hf_greedy(hf_model(llama_model), generating, 10)
    for prompt, result in zip(prompts, results[1:]):
        expected = F.normalize(hf_hidden(llama_model, prompt)[-1], dim=-1)
        assert result.pooled is not None and len(result.pooled) == TINY["hidden_size"]
        torch.testing.assert_close(torch.tensor(result.pooled), expected, atol=1e-5, rtol=1e-4)
    assert llm.engine.kv_cache.pool.num_free_blocks == NUM_BLOCKS
    assert llm.engine.runner.pooling_ids == set()


def test_embed_dimensions_truncate_and_renormalize(llama_model: Path) -> None:
    llm = engine(llama_model)
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    full, short = llm.embed([prompt])[0].embedding, llm.embed([prompt], dimensions=8)[0].embedding
    expected = F.normalize(torch.tensor(full[:8]), dim=-1)
    torch.testing.assert_close(torch.tensor(short), expected)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([prompt], dimensions=TINY["hidden_size"] + 1)


def test_mean_pooling_from_the_sentence_transformers_config(llama_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "st-mean"
    shutil.copytree(llama_model, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    llm = engine(folder)
    assert llm.pooling.pooling_type == "MEAN"
    prefix = random_prompts(1, 48, 48, seed=10)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 5, 30, seed=11)]
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)  # leaves the prefix's blocks cached
    for prompt, out in zip(prompts, llm.embed(prompts)):
        expected = F.normalize(hf_hidden(folder, prompt).mean(dim=0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-5, rtol=1e-4)
    assert llm.engine.kv_cache.pool.num_free_blocks == NUM_BLOCKS


def test_a_preempted_mean_pooling_request_pools_again_from_the_start(llama_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "st-mean"
    shutil.copytree(llama_model, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    pooling = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(pooling))
    # 22 blocks of 4 tokens: the 84-token prompt's third chunk finds no room beside the generating request,
    # so it is preempted after two chunks were summed, and computed again once the generation ends.
    llm = engine(folder, num_kv_blocks=22, block_size=4)
    prompt = random_prompts(1, 84, 84, seed=13)[0]
    generate = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    prepared = [
        llm.inputs.process("gen", [5, 6, 7, 8], generate),
        llm.inputs.process_pooling("emb", prompt, llm.pooling.params("embed")),
    ]
    pooled = llm._run(prepared, use_tqdm=False)[1].pooled
    assert llm.engine.scheduler.stats.num_preemptions > 0
    expected = F.normalize(hf_hidden(folder, prompt).mean(dim=0), dim=-1)
    torch.testing.assert_close(torch.tensor(pooled), expected, atol=1e-5, rtol=1e-4)
    assert llm.engine.kv_cache.pool.num_free_blocks == 22


@pytest.fixture(scope="module")
def classifier_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("llama-cls")
    config = AutoConfig.for_model("llama", **(TINY | dict(num_labels=1, tie_word_embeddings=False)))
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@torch.inference_mode()
def hf_classifier_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    return model(torch.tensor([prompt])).logits[0]


def test_classifier_score_equals_hf_sequence_classification(classifier_model: Path) -> None:
    llm = engine(classifier_model)
    prompts = random_prompts(3, 5, 60, seed=12, vocab=300)
    for prompt, out in zip(prompts, llm.classify(prompts)):
        torch.testing.assert_close(torch.tensor(out.logits), hf_classifier_logits(classifier_model, prompt))
    query, docs = "the capital of France", ["Paris is the capital.", "12345 + 678"]
    scores = llm.score(query, docs)
    for doc, score in zip(docs, scores):
        pair = llm.get_tokenizer()(query, doc)["input_ids"]  # type: ignore[misc]
        assert score.method == "classification"
        assert score.score == pytest.approx(float(hf_classifier_logits(classifier_model, pair)[0]), abs=1e-5)
    with pytest.raises(ValueError, match="classifier"):
        llm.generate(["hi"], use_tqdm=False)
    assert llm.engine.kv_cache.pool.num_free_blocks == NUM_BLOCKS
