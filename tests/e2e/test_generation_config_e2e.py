"""A model's sampling defaults from its generation_config.json, through an engine on the tiny llama: the
engine config carries them, and the offline API (LLM) samples with them. Reading the file and the
precedence rules alone: tests/unit/test_generation_config.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.unit.test_generation_config import write_generation_config
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config


def test_the_engine_config_carries_the_defaults(llama_model: Path, tmp_path: Path) -> None:
    folder = write_generation_config(tmp_path, {"temperature": 0.3})
    config, _ = create_engine_config(EngineArgs(model=str(llama_model), generation_config=str(folder)))
    assert config.model.sampling_defaults == {"temperature": 0.3}
    assert config.model.generation_config == str(folder)


# ---------------------------------------------------------------------- the offline API


@pytest.fixture(scope="module")
def greedy_model(llama_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama whose generation_config.json asks for greedy decoding and 5 tokens."""
    folder = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(llama_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    write_generation_config(folder, config | {"temperature": 0.0, "max_new_tokens": 5})
    return folder


def test_llm_default_sampling_params_come_from_the_model(greedy_model: Path) -> None:
    llm = LLM(str(greedy_model), dtype="float32", num_kv_blocks=16, max_model_len=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_p) == (0.0, 5, 1.0)


def test_llm_generate_without_sampling_params_uses_the_models_defaults(greedy_model: Path) -> None:
    llm = LLM(str(greedy_model), dtype="float32", num_kv_blocks=16, max_model_len=64)
    prompt = [10, 11, 12]  # greedy runs 5 tokens without meeting eos
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert default.token_ids == greedy.token_ids and len(default.token_ids) == 5


def test_llm_with_generation_config_vllm_uses_samplingparams_own(greedy_model: Path) -> None:
    llm = LLM(str(greedy_model), dtype="float32", num_kv_blocks=16, max_model_len=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
