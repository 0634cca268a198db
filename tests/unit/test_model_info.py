"""`tokenmill info MODEL` (tokenmill/bench/model_info.py): supported or not, and the model's shape,
from config.json / GGUF metadata and tensor headers, before any weight is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import save_file

from tokenmill.bench.model_info import describe_model
from tokenmill.cli import main


def _folder(tmp_path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_supported_folder_reports_its_family_layers_and_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_hidden_layers": 2}
    tensors = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    folder = _folder(tmp_path, config, tensors)
    main(["info", str(folder), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["supported"] and info["architecture"] == "Phi3ForCausalLM" and info["model_type"] == "phi3"
    assert info["num_layers"] == 2 and info["num_parameters"] == 17
    assert info["num_experts"] is None


def test_a_mixture_of_experts_reports_its_experts_and_top_k(tmp_path: Path) -> None:
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}
    info = describe_model(_folder(tmp_path, config, {"w": torch.zeros(2)}))
    assert info.supported and info.architecture == "Qwen3MoeForCausalLM"
    assert (info.num_experts, info.experts_per_token) == (128, 8)


def test_an_unsupported_folder_exits_non_zero_naming_the_supported_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, {"w": torch.zeros(2)})
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(folder)])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert "supported     no" in out
    assert "GPT2LMHeadModel" in err and "Olmo2ForCausalLM" in err and "Phi3ForCausalLM" in err


def test_an_unsupported_gguf_architecture_is_reported_without_loading(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = describe_model(path)
    assert not info.supported and info.architecture == "gpt2" and info.num_parameters == 32
    assert "not supported" in info.message


def test_neither_a_folder_nor_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a model folder"):
        describe_model(tmp_path)
