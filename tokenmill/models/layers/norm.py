"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.ops.triton_ops import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in fp32 as HF does, so bf16 models round the same way.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual): residual + x is both the next residual and the norm's input.
        With a residual, both x and residual may be updated in place (the caller owns them)."""
        fused = triton_ops(x)
        rows = x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
        if fused is not None and rows:  # CUDA: one kernel, no float32 copies
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps), x
            fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        ops = cpu_ops(x) if residual is not None else None
        if ops is not None and residual is not None and x.is_contiguous() and residual.is_contiguous():
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = x + residual
        return self._norm(x), x
