"""Our rotary tables against transformers' own rope init functions (ROPE_INIT_FUNCTIONS) on the same
config: cos and sin equal at every position HF computes the same way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

HEAD_DIM = 32


def hf_tables(config: Any, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin (first half: rotate-half repeats the angles) at `positions`, [n, rotary_dim / 2]."""
    rope_type = config.rope_parameters["rope_type"]
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    freqs = torch.outer(positions.float(), inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


def ours(config: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(HEAD_DIM, 256, rope_parameters(config))
    cos, sin = rope(positions)
    return cos[:, 0], sin[:, 0]


def llama(rope: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256, rope_scaling=rope)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.7,
            "mscale_all_dim": 1,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
    ],
    ids=["defaults", "betas", "attention-factor", "mscale", "no-truncate"],
)
def test_yarn_tables_equal_hf(rope: dict[str, Any]) -> None:
    config = llama(dict(rope, rope_theta=10000.0))
    positions = torch.arange(256)
    hf_cos, hf_sin = hf_tables(config, positions)
    cos, sin = ours(config, positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)  # the same arithmetic, bit for bit
    assert not torch.allclose(cos, ours(llama({"rope_type": "default", "rope_theta": 10000.0}), positions)[0])


def phi3(partial: float) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        partial_rotary_factor=partial,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
        },
    )


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_factors_below_the_original_length_long_from_it(partial: float) -> None:
    config = phi3(partial)
    below, beyond = torch.arange(64), torch.arange(64, 256)
    cos, sin = ours(config, torch.arange(256))
    assert cos.shape == (256, int(HEAD_DIM * partial) // 2)
    short_cos, short_sin = hf_tables(config, below)  # HF within the original length
    long_cos, long_sin = hf_tables(config, beyond, seq_len=65)  # HF past it
    torch.testing.assert_close(cos[:64], short_cos)
    torch.testing.assert_close(sin[:64], short_sin)
    torch.testing.assert_close(cos[64:], long_cos)
    torch.testing.assert_close(sin[64:], long_sin)
    assert abs(float(cos[0, 0]) - 1.0) > 1e-3  # scaled by the attention factor sqrt(1 + ln 4 / ln 64)


def test_partial_rotary_rotates_only_the_leading_dims_as_hf() -> None:
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = phi3(0.5)
    positions = torch.arange(5, 12)
    cos, sin = ours(config, positions)  # [7, 8]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, HEAD_DIM, generator=gen)
    k = torch.randn(7, 2, HEAD_DIM, generator=gen)
    hf_q, hf_k = apply_rotary_pos_emb(  # [1, H, n, D] with rotate-half's repeated angles
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        torch.cat([cos, cos], -1)[None],
        torch.cat([sin, sin], -1)[None],
    )
    our_q, our_k = apply_rotary((cos[:, None], sin[:, None]), q.clone(), k.clone())
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1))
    torch.testing.assert_close(our_q[..., 16:], q[..., 16:])
