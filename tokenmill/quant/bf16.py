"""bf16 weights packed for our C++ GEMM (ops/csrc/packed_gemm.h), float32 activations in and out.

On CPUs with AVX-512 BF16 the kernel rounds the activation rows to bf16 and multiplies with bf16
dot-product instructions (float32 sums; k-pair panels); elsewhere (AVX2) it widens the weights to
float32 in registers (interleaved panels), since torch's bf16 GEMMs run several times slower than
fp32 there. Either way decode, which is bound by reading the weights, moves half the bytes of fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import packed_gemm
from tokenmill.quant.panels import PANEL, pack_bf16, unpack_bf16


class Bf16Linear(nn.Module):
    """y = x @ weight.T + bias with weight [out, in] kept as packed bf16; float32 in and out."""

    packed: torch.Tensor
    ones: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, row_parallel: bool = False) -> None:
        """row_parallel (a tensor-parallel shard of the input columns) changes nothing: each shard packs as is."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        pad = (-self.out_features) % PANEL
        self.pairs = packed_gemm.isa() == "avx512"  # the layout the built kernel reads (panels.py)
        # [P, in, 16] (interleaved) or [P, in + in % 2, 16] (k pairs)
        self.register_buffer("packed", pack_bf16(weight.detach().to(torch.bfloat16), self.pairs))
        self.register_buffer("ones", torch.ones(self.out_features + pad))  # the kernel's per-channel scale
        bias = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", F.pad(bias, (0, pad)))

    def weight_bf16(self) -> torch.Tensor:
        """The weight as bf16 [out, in]."""
        return unpack_bf16(self.packed, self.out_features, self.in_features, self.pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return packed_gemm.packed_linear(x.float().contiguous(), self.packed, self.ones, self.bias, self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection (the MLP's): [num_tokens, in] -> [num_tokens, out / 2].
        Where the halves are whole panels, the activation runs in the GEMM's epilogue, so the [num_tokens,
        out] projection is never written out and read back."""
        if self.out_features % (2 * PANEL):
            return split_silu_mul(self(x))
        return packed_gemm.packed_linear_silu_mul(
            x.float().contiguous(), self.packed, self.ones, self.bias, self.out_features
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 packed"


def split_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] (gate | up) -> [..., I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
