"""Per-output-channel symmetric int8 weights, quantized at load time from a float checkpoint.

On CPU the GEMM is our C++ kernel (ops/csrc/packed_gemm.h), integer multiply-adds that never widen the
weights to float; decode reads a quarter of the bytes of fp32 weights. The activations are quantized
per call:
- AVX-512 VNNI: to int8 in groups of 32 values, one scale per group (llama.cpp's q8_0), with
  vpdpbusd, 64 multiply-adds per instruction: twice the rate of bf16 (or int16) dot products.
- AVX2: to int16 rows (one scale per row, max|x| / 32767) with vpmaddwd up to 511 rows; from 512
  rows a float32 GEMM on weights dequantized once.

Why groups: fbgemm's dynamic int8 linear (`quantized::linear_dynamic`) on SmolLM2 cost +177%
perplexity with a per-tensor activation scale and +8% with a per-token one (+4.6% even at 8 bits),
from outlier channels. Per-32-value scales keep perplexity (the quality test checks it); int16
rows keep it with one scale per row (an error of at most 1.5e-5 of the row's largest value)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.communication import all_reduce_max_
from tokenmill.ops import packed_gemm
from tokenmill.quant.bf16 import split_silu_mul
from tokenmill.quant.panels import PANEL, pack_int8, unpack_int8


def quantize_per_channel(weight: torch.Tensor, row_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out]) with weight ~= q * scale[:, None].

    Symmetric, range [-127, 127]: each row's largest magnitude maps to 127 (all-zero rows get a tiny
    scale and stay zero). row_parallel: `weight` is this tensor-parallel rank's slice of the input
    columns; the row maxima are taken over every rank's slice, so the scales (and the int8 values) are
    those of the whole weight."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)  # [out]
    if row_parallel:
        all_reduce_max_(absmax)
    scale = (absmax / 127.0).clamp_min(1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def default_kernel(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" and packed_gemm.available() else "reference"


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias, with q int8 [out, in] and one float32 scale per output
    channel; float inputs [num_tokens, in] and outputs [num_tokens, out] in the input's dtype.

    `kernel` is fixed at construction: "cpu" (the C++ kernel, weights stored packed) or "reference"
    (dequantize on the fly with F.linear; any device)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> None:
        super().__init__()
        if kernel not in ("cpu", "reference"):
            raise ValueError(f"unknown int8 kernel {kernel!r}; use 'cpu' or 'reference'.")
        self.out_features, self.in_features = q.shape
        self.kernel = kernel
        pad = (-self.out_features) % PANEL if kernel == "cpu" else 0
        bias = torch.zeros_like(scale) if bias is None and kernel == "cpu" else bias
        self.quads = kernel == "cpu" and packed_gemm.isa() == "avx512"  # the layout the built kernel reads
        # cpu: [num_panels, in padded, 16] int8 (panels.py) and padded [num_panels * 16] scale and
        # bias; reference: [out, in]
        self.register_buffer("qweight", pack_int8(q, self.quads) if kernel == "cpu" else q)
        self.register_buffer("scale", F.pad(scale.float(), (0, pad)))
        self.register_buffer("bias", None if bias is None else F.pad(bias.detach().float(), (0, pad)))

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernel: str | None = None,
        row_parallel: bool = False,
    ) -> Int8Linear:
        """Quantize a float weight [out, in] (and keep its bias in float32); row_parallel: see
        quantize_per_channel."""
        q, scale = quantize_per_channel(weight, row_parallel)
        return cls(q, scale, bias, kernel or default_kernel(weight.device))

    def int8_weight(self) -> torch.Tensor:
        """The quantized weight as int8 [out, in], whatever the storage layout."""
        if self.kernel == "cpu":
            return unpack_int8(self.qweight, self.out_features, self.in_features, self.quads)
        return self.qweight

    def dequantize(self) -> torch.Tensor:
        return dequantize_per_channel(self.int8_weight(), self.scale[: self.out_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.kernel == "cpu":
            assert self.bias is not None  # the cpu kernel's layers always have one (zeros where none was given)
            y = packed_gemm.packed_linear(
                x.float().contiguous(), self.qweight, self.scale, self.bias, self.out_features
            )
        else:
            y = F.linear(x.float(), self.qweight.float()) * self.scale
            if self.bias is not None:
                y = y + self.bias
        return y.to(x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection (the MLP's): [num_tokens, in] -> [num_tokens, out / 2],
        in the C++ GEMM's epilogue where the halves are whole panels (see Bf16Linear.silu_and_mul)."""
        if self.kernel != "cpu" or self.out_features % (2 * PANEL):
            return split_silu_mul(self(x))
        assert self.bias is not None  # as in forward
        y = packed_gemm.packed_linear_silu_mul(
            x.float().contiguous(), self.qweight, self.scale, self.bias, self.out_features
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"
