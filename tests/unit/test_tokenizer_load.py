"""load_tokenizer hands AutoTokenizer transformers' generic config (cheap to import) where the tokenizer names
its class; the reference is AutoTokenizer loading the family's own config, on the same folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.tiny_models import FAMILIES, TINY, make_tiny_tokenizer
from tokenmill.loader.hf import load_tokenizer

TEXTS = ["Hello world! 12345", " leading space, <|im_start|> special", "ünïcödé ✓"]
CHAT = [{"role": "user", "content": "Hi"}]


def _folder(tmp_path: Path, family: str, tokenizer_class: str | None = None) -> Path:
    spec = dict(FAMILIES[family])
    folder = tmp_path / family
    AutoConfig.for_model(spec.pop("model_type"), **(TINY | spec)).save_pretrained(folder)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    tokenizer.save_pretrained(folder)
    if tokenizer_class is not None:
        config_file = folder / "tokenizer_config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"tokenizer_class": tokenizer_class}))
    return folder


def _behaviour(tokenizer: Any) -> tuple[Any, ...]:
    return (
        type(tokenizer),
        [tokenizer.encode(text) for text in TEXTS],
        [tokenizer.decode(tokenizer.encode(text)) for text in TEXTS],
        tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        tokenizer.all_special_tokens,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        len(tokenizer),
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_loads_the_tokenizer_autotokenizer_loads(tmp_path: Path, family: str) -> None:
    folder = _folder(tmp_path, family)
    assert _behaviour(load_tokenizer(folder)) == _behaviour(AutoTokenizer.from_pretrained(str(folder)))


@pytest.mark.parametrize("declared", ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer", "NoSuchOne"])
def test_a_declared_tokenizer_class_resolves_as_in_autotokenizer(tmp_path: Path, declared: str) -> None:
    folder = _folder(tmp_path, "qwen2", tokenizer_class=declared)
    assert _behaviour(load_tokenizer(folder)) == _behaviour(AutoTokenizer.from_pretrained(str(folder)))
