"""TOKENMILL_CPU_ISA=avx2: the C++ kernels built with -march=x86-64-v3 (AVX2 and FMA, no AVX-512), as on
CPUs without AVX-512, checked against plain torch on this CPU whatever it has. The C++ picks its paths
at compile time (#ifdef __AVX512BF16__ ...), so on an AVX-512 BF16 machine this is the one way the
AVX2 paths run here. The switch is read once per process, so the checks run in a subprocess; its
extensions are cached beside the native ones (names ending in _avx2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.ops.build import cpu_has_avx2

pytestmark = [
    pytest.mark.skipif(
        not cpu_has_avx2(),
        reason="this CPU lacks AVX2 and FMA (or /proc/cpuinfo does not say): code built for "
        "x86-64-v3 would not run on it",
    ),
    pytest.mark.timeout(1800),  # the first run builds three extensions for AVX2
]

REPO = Path(__file__).resolve().parents[2]

# Runs under TOKENMILL_CPU_ISA=avx2; prints one JSON object: check name -> "ok" or the failure.
_SCRIPT = r"""
import json, traceback

import torch
import torch.nn.functional as F

from tokenmill.ops import build, packed_gemm
from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.quant import Bf16Linear, Int8Linear

results = {}


def check(fn):
    try:
        fn()
        results[fn.__name__] = "ok"
    except Exception:  # reported, and failed, by the test of the same name
        results[fn.__name__] = traceback.format_exc()
    return fn


@check
def isa_switch():
    assert build.cpu_isa() == "avx2", build.cpu_isa()
    assert not build.cpu_has_avx512_bf16()
    assert "-march=x86-64-v3" in build.cflags() and "-march=native" not in build.cflags()
    assert build.extension_name("cpu_ops") == "tokenmill_cpu_ops_avx2"


@check
def packed_gemm_is_the_avx2_build():
    assert packed_gemm.available(), "the AVX2 packed GEMM could not be built"
    assert packed_gemm.isa() == "avx2", packed_gemm.isa()


@check
def bf16_gemm_multiplies_the_bf16_weights_exactly():
    # AVX2: float32 sums of float32 activations times the bf16 weights widened (register tiles,
    # pre-widened panels, from 512 rows a dense float32 GEMM).
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 77, generator=gen) * 10.0 ** torch.empty(40, 1).uniform_(-3, 1, generator=gen)
    bias = torch.randn(40, generator=gen)
    layer = Bf16Linear(w, bias)
    assert not layer.pairs  # the AVX2 (interleaved) panel layout
    assert torch.equal(layer.weight_bf16(), w.bfloat16())
    for rows in (1, 3, 7, 20, 130, 600):
        x = torch.randn(rows, 77, generator=gen)
        expected = x.double() @ w.bfloat16().double().T + bias.double()
        magnitude = x.double().abs() @ w.bfloat16().double().abs().T + bias.double().abs()
        # float32 sums: a rounding error relative to the magnitude of the products, in any order
        assert ((layer(x).double() - expected).abs() <= 1e-5 * (1 + magnitude)).all()


@check
def bf16_gemm_silu_mul_epilogue():
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(96, 77, generator=gen) * 0.1, torch.randn(96, generator=gen)
    layer = Bf16Linear(w, bias)
    for rows in (1, 8, 37):
        x = torch.randn(rows, 77, generator=gen)
        gate, up = layer(x).chunk(2, dim=-1)
        torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@check
def int8_gemm_is_close_to_fp32():
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 96)
    layer = Int8Linear.from_weight(linear.weight, linear.bias, kernel="cpu")
    assert not layer.quads  # the AVX2 (k pair) panel layout
    for rows in (1, 13, 600):  # int16 rows (register tiles), and from 512 rows a float32 GEMM
        x = torch.randn(rows, 576)
        expected = linear(x).detach()
        got = layer(x)
        assert (got - expected).norm() / expected.norm() < 0.02


@check
def fused_ops_match_torch():
    ops = cpu_ops(torch.empty(1))
    assert ops is not None, "the AVX2 fused CPU ops could not be built"
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(7, 96, generator=gen), torch.randn(7, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    summed = x + residual
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    ops.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, summed)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(9, 2 * 40, generator=gen) * 4
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)

    n, hq, hkv, d = 6, 4, 2, 16
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(n, d // 2, generator=gen) * 6
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    want = qkv.clone().view(n, hq + 2 * hkv, d)
    x1, x2 = want[:, : hq + hkv, : d // 2].clone(), want[:, : hq + hkv, d // 2 :].clone()
    want[:, : hq + hkv] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # rotate half
    ops.rotary_(qkv, hq + hkv, d, cos, sin)
    torch.testing.assert_close(qkv.view(n, hq + 2 * hkv, d), want, rtol=1e-5, atol=1e-6)

    logits = torch.randn(5, 49_152, generator=gen)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # ties: the first, as torch.argmax
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


@check
def attention_takes_the_portable_kernel():
    kernels = build.load("paged_decode")
    assert kernels is not None, "the AVX2 paged-decode kernel could not be built"
    gen = torch.Generator().manual_seed(4)
    num_seqs, heads, kv_heads, head_dim, block, num_blocks = 3, 8, 2, 64, 16, 32
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
    assert not kernels.avx512_supports(cache)  # no AVX-512 BF16 kernel in this build
    lens = torch.tensor([5, 33, 64], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * 4].view(num_seqs, 4).to(torch.int32)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    got = kernels.paged_decode(q, cache, tables, lens, head_dim**-0.5)
    for s in range(num_seqs):
        n = int(lens[s])
        k, v = (cache[i][tables[s]].reshape(-1, kv_heads, head_dim)[:n].double() for i in (0, 1))
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double() * head_dim**-0.5, k), dim=-1)
        torch.testing.assert_close(got[s].double(), torch.einsum("hn,nhd->hd", p, v), rtol=0, atol=1e-5)


print("ISA_RESULTS " + json.dumps(results))
"""

CHECKS = [
    "isa_switch",
    "packed_gemm_is_the_avx2_build",
    "bf16_gemm_multiplies_the_bf16_weights_exactly",
    "bf16_gemm_silu_mul_epilogue",
    "int8_gemm_is_close_to_fp32",
    "fused_ops_match_torch",
    "attention_takes_the_portable_kernel",
]


@pytest.fixture(scope="module")
def avx2_results() -> dict[str, str]:
    env = {**os.environ, "TOKENMILL_CPU_ISA": "avx2"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=1700
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ISA_RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"the AVX2 subprocess failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return json.loads(lines[-1].removeprefix("ISA_RESULTS "))


@pytest.mark.parametrize("name", CHECKS)
def test_avx2_build(avx2_results: dict[str, str], name: str) -> None:
    assert avx2_results.get(name) == "ok", avx2_results.get(name, f"{name} did not run")
