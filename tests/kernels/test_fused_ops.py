"""The C++ fused CPU ops against the PyTorch formulas they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import apply_rotary
from tokenmill.ops import build


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    module = build.load("cpu_ops")
    assert module is not None, "the fused CPU ops must build here (CI has a compiler and ninja)"
    return module


def test_add_rms_norm_matches_residual_add_then_rmsnorm(ops) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(7, 96, generator=gen), torch.randn(7, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    summed = x + residual
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    ops.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, summed)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_rmsnorm_module_uses_the_fused_op_and_agrees_with_its_torch_path() -> None:
    norm = RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    got_normed, got_residual = norm(x.clone(), residual.clone())  # fused, in place on the copies
    torch.testing.assert_close(got_residual, x + residual)
    torch.testing.assert_close(got_normed, norm._norm(x + residual), rtol=1e-5, atol=1e-5)


def test_silu_and_mul(ops) -> None:  # type: ignore[no-untyped-def]
    gate_up = torch.randn(9, 2 * 40) * 4
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rotary_in_place_on_fused_qkv_rows_matches_apply_rotary(ops) -> None:  # type: ignore[no-untyped-def]
    n, hq, hkv, d = 6, 4, 2, 16
    qkv = torch.randn(n, (hq + 2 * hkv) * d)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [n, 1, d / 2], as the model passes them
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    want_q, want_k = apply_rotary((cos, sin), q.reshape(n, hq, d), k.reshape(n, hkv, d))
    want_v = v.clone()
    ops.rotary_(qkv, hq + hkv, d, cos, sin)
    got_q, got_k, got_v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(got_q.reshape(n, hq, d), want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k.reshape(n, hkv, d), want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_v, want_v)  # the value heads are not rotated
