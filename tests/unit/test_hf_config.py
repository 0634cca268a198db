"""A model's config as tokenmill loads it (tokenmill.loader.hf_config): transformers resolves a config.json once,
later loads read the cached values. The reference is transformers' AutoConfig on the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from tests.tiny_models import FAMILIES, TINY
from tokenmill.loader.hf_config import HFConfig, config_for_model, load_hf_config
from tokenmill.loader.model_source import checkpoint_dtype
from tokenmill.loader.presets import PRESETS

# Every config attribute tokenmill's code reads (models/*, loader/*, engine_args, config.py, worker/*),
# properties and attribute_map aliases included; the comparison also covers everything in to_dict().
READ_BY_TOKENMILL = (
    "architectures", "attention_bias", "attention_multiplier", "attn_logit_softcapping", "bos_token_id",
    "decoder_sparse_step", "dtype", "embedding_multiplier", "eos_token_id", "final_logit_softcapping", "head_dim",
    "hidden_act", "hidden_size", "id2label", "intermediate_size", "layer_types", "logits_scaling",
    "max_position_embeddings", "mlp_only_layers", "model_type", "moe_intermediate_size", "norm_topk_prob",
    "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
    "num_labels", "num_local_experts", "original_max_position_embeddings", "pad_token_id", "partial_rotary_factor",
    "qkv_bias", "query_pre_attn_scalar", "residual_multiplier", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "shared_expert_intermediate_size", "sliding_window", "sliding_window_pattern", "tie_word_embeddings",
    "use_sliding_window", "vocab_size",
)  # fmt: skip
_MISSING = object()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))


def _family_folder(tmp_path: Path, family: str) -> Path:
    spec = dict(FAMILIES[family])
    folder = tmp_path / family
    AutoConfig.for_model(spec.pop("model_type"), **(TINY | spec), dtype="bfloat16").save_pretrained(folder)
    return folder


def _differences(ours: Any, reference: Any) -> dict[str, tuple[Any, Any]]:
    names = {*READ_BY_TOKENMILL, *reference.to_dict()}
    pairs = {name: (getattr(ours, name, _MISSING), getattr(reference, name, _MISSING)) for name in names}
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_loads_the_values_autoconfig_resolves(tmp_path: Path, family: str) -> None:
    folder = _family_folder(tmp_path, family)
    reference = AutoConfig.from_pretrained(str(folder))
    first, cached = load_hf_config(folder), load_hf_config(folder)  # resolved by transformers, then from the cache
    assert isinstance(cached, HFConfig)
    assert _differences(first, reference) == {}
    assert _differences(cached, reference) == {}
    assert cached.dtype is torch.bfloat16 and checkpoint_dtype(cached) == checkpoint_dtype(reference) == "bfloat16"


def test_a_cached_config_is_read_without_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _family_folder(tmp_path, "gemma3")
    expected = load_hf_config(folder).to_dict()

    def no_transformers(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cached config was resolved again")

    monkeypatch.setattr(AutoConfig, "from_pretrained", no_transformers)
    assert load_hf_config(folder).to_dict() == expected


def test_an_edited_config_json_is_resolved_again(tmp_path: Path) -> None:
    folder = _family_folder(tmp_path, "llama")
    assert load_hf_config(folder).rms_norm_eps == 1e-6
    config_file = folder / "config.json"
    config_file.write_text(config_file.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert load_hf_config(folder).rms_norm_eps == 1e-5


def test_copies_of_a_config_share_one_cache_entry_and_keep_their_own_path(tmp_path: Path) -> None:
    first = _family_folder(tmp_path / "a", "qwen2")
    second = _family_folder(tmp_path / "b", "qwen2")
    load_hf_config(first)
    assert load_hf_config(second).name_or_path == str(second) == AutoConfig.from_pretrained(str(second)).name_or_path
    assert len(list((tmp_path / "cache" / "hf_configs").iterdir())) == 1


def test_a_damaged_cache_entry_is_resolved_again(tmp_path: Path) -> None:
    folder = _family_folder(tmp_path, "mixtral")
    expected = load_hf_config(folder).to_dict()
    (entry,) = (tmp_path / "cache" / "hf_configs").iterdir()
    entry.write_text("{'vocab_size': 5")
    assert load_hf_config(folder).to_dict() == expected
    assert load_hf_config(folder).to_dict() == expected  # and written again


def test_a_missing_attribute_raises_attribute_error_as_transformers_does(tmp_path: Path) -> None:
    config = load_hf_config(_family_folder(tmp_path, "llama"))
    assert getattr(config, "num_local_experts", None) is None
    with pytest.raises(AttributeError, match="num_local_experts"):
        _ = config.num_local_experts


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_dummy_preset_loads_the_values_autoconfig_builds(preset: str) -> None:
    values = dict(PRESETS[preset])
    reference = AutoConfig.for_model(values.pop("model_type"), **values)
    assert _differences(config_for_model(PRESETS[preset]), reference) == {}
    assert _differences(config_for_model(PRESETS[preset]), reference) == {}
