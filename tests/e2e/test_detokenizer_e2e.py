"""IncrementalDetokenizer with a real model's tokenizer (SmolLM2's, from the converted default model),
against `tokenizer.decode` of the whole sequence. The small trained tokenizers: tests/unit/test_detokenizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.unit.test_detokenizer import decode, stream

SMOLLM2_DIR = Path.home() / ".cache/tokenmill/models/SmolLM2-135M-Instruct"


@pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason=f"no converted SmolLM2 tokenizer at {SMOLLM2_DIR}")
def test_smollm2_tokenizer_streams_its_own_decode() -> None:
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    prompt_ids = tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("Héllo wörld 你好 🙂 — done.") + [tokenizer.eos_token_id]
    detok, deltas = stream(tokenizer, ids, prompt_ids=prompt_ids)
    assert "".join(deltas) == detok.output_text == decode(tokenizer, ids)
    assert not any("\ufffd" in delta for delta in deltas)
