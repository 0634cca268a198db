"""bf16 weights on CPUs without bf16 arithmetic: stored as bf16, multiplied in float32.

On such CPUs (AVX2, no AVX-512 BF16 / AMX) torch's bf16 GEMMs are several times slower than fp32,
so `--dtype bfloat16` computes in float32 on the bf16-rounded weights. Kept as float32 tensors those
weights cost fp32's memory traffic, which is what bounds decode; packed as bf16 for the C++ kernel
(csrc/packed_gemm.h, which widens them in registers) they move half the bytes. The numbers are the
same: a bf16 value is exactly a float32 value."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant.panels import PANEL, pack_bf16, unpack_bf16


class Bf16Linear(nn.Module):
    """y = x @ weight.T + bias with weight [out, in] kept as packed bf16; float32 in and out."""

    packed: torch.Tensor
    ones: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        pad = (-self.out_features) % PANEL
        self.register_buffer("packed", pack_bf16(weight.detach().to(torch.bfloat16)))  # [P, in, 16]
        self.register_buffer("ones", torch.ones(self.out_features + pad))  # the kernel's per-channel scale
        bias = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", F.pad(bias, (0, pad)))

    def weight_bf16(self) -> torch.Tensor:
        """The weight as bf16 [out, in]."""
        return unpack_bf16(self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return torch.ops.tokenmill_quant.packed_linear(x.float().contiguous(), self.packed, self.ones, self.bias,
                                                       self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 packed"
