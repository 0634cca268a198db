"""Tiny random models of each supported family, saved as real HF folders, and HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Small but not trivial: GQA (4 query heads on 2 KV heads), several blocks per prompt.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Wider than the default 0.02 so logits are far apart and greedy ties cannot flip between
    # two correct implementations that round differently.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied-rope-scaling": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32),
}


def make_tiny_model(folder: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """overrides: config fields on top of the family's (head_dim=32, say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family]) | overrides
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **TINY, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation (argmax each step, never stopping at eos, never
    suppressing it): the reference our engine must equal token for token."""
    out, past, inputs = [], None, torch.tensor([prompt])
    for _ in range(max_new_tokens):
        result = model(inputs, past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        inputs = torch.tensor([[token]])
    return out


def random_prompts(n: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]
