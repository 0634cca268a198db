"""bf16 weights packed for our C++ GEMM (ops/csrc/packed_gemm.h), float32 activations in and out; and float32
weights in the same panels for AVX2 builds (Fp32Linear).

On CPUs with AVX-512 BF16 the kernel rounds the activation rows to bf16 and multiplies with bf16
dot-product instructions (float32 sums; k-pair panels); elsewhere (AVX2) it widens the weights to
float32 in registers (interleaved panels), since torch's bf16 GEMMs run several times slower than
fp32 there. Either way decode, which is bound by reading the weights, moves half the bytes of fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import packed_gemm
from tokenmill.quant.panels import PANEL, pack_bf16, pack_f32, unpack_bf16


class PackedFloatLinear(nn.Module):
    """y = x @ weight.T + bias with weight [out, in] packed in panels of 16 channels for the C++ GEMM;
    float32 in and out. Bf16Linear and Fp32Linear pack it."""

    packed: torch.Tensor
    ones: torch.Tensor
    bias: torch.Tensor
    kind = ""  # what the panels hold, for repr

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        pad = (-out_features) % PANEL
        self.register_buffer("packed", packed)  # [P, in(+1), 16]
        self.register_buffer("ones", torch.ones(out_features + pad))  # the kernel's per-channel scale
        bias = torch.zeros(out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", F.pad(bias, (0, pad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return packed_gemm.packed_linear(x.float().contiguous(), self.packed, self.ones, self.bias, self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection (the MLP's): [num_tokens, in] -> [num_tokens, out / 2].
        Where the halves are whole panels, the activation runs in the GEMM's epilogue (AVX-512 builds), so
        the [num_tokens, out] projection is never written out and read back."""
        if self.out_features % (2 * PANEL):
            return split_silu_mul(self(x))
        return packed_gemm.packed_linear_silu_mul(
            x.float().contiguous(), self.packed, self.ones, self.bias, self.out_features
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind} packed"


class Bf16Linear(PackedFloatLinear):
    """bf16 weights: k pairs for AVX-512 BF16 dot products, else interleaved for widening (panels.py)."""

    kind = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, row_parallel: bool = False) -> None:
        """row_parallel (a tensor-parallel shard of the input columns) changes nothing: each shard packs as is."""
        pairs = packed_gemm.isa() == "avx512"  # the layout the built kernel reads (panels.py)
        out_features, in_features = weight.shape
        super().__init__(pack_bf16(weight.detach().to(torch.bfloat16), pairs), out_features, in_features, bias)
        self.pairs = pairs

    def weight_bf16(self) -> torch.Tensor:
        """The weight as bf16 [out, in]."""
        return unpack_bf16(self.packed, self.out_features, self.in_features, self.pairs)


class Fp32Linear(PackedFloatLinear):
    """float32 weights, channels in order (AVX2 builds only): a decode batch's few rows run at the FMA
    peak, where the BLAS sgemm runs them well below it. float32 FMAs either way; each output is one sum
    in k order, as for bf16 panels."""

    kind = "float32"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, row_parallel: bool = False) -> None:
        if packed_gemm.isa() != "avx2":
            raise ValueError(f"float32 panels need the AVX2 build of the packed GEMM, not {packed_gemm.isa()!r}")
        out_features, in_features = weight.shape
        super().__init__(pack_f32(weight.detach().float()), out_features, in_features, bias)


def split_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] (gate | up) -> [..., I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
