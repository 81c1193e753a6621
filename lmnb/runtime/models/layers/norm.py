"""RMSNorm, with the residual add folded in (the decoder passes `hidden, residual` along)."""

from __future__ import annotations

import torch
from torch import nn

from lmnb.runtime.models.layers.fp8 import Fp8Rows
from lmnb.runtime.models.layers.fusion import Fusable


class RMSNorm(Fusable):
    """`norm(x)` -> normed x; `norm(x, residual)` -> (normed x + residual, x + residual).

    The torch path adds in the model dtype, normalises in float32, rounds to the model dtype and
    multiplies by the weight (HF's order); the fused kernel rounds at the same places."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from lmnb.runtime.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * y.to(dtype)
        return out if residual is None else (out, residual)

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> tuple[Fp8Rows, torch.Tensor | None]:
        """The fused kernel's normed x [tokens, hidden] quantized per token to FP8 in the same
        kernel, for a W8A8 GEMM behind it (`rms_norm_quant`; the 16-bit normed rows are never
        written) -> (the FP8 rows, x + residual; None without `residual`)."""
        from lmnb.runtime.kernels.fused.rmsnorm import rms_norm_quant

        codes, scale, stream = rms_norm_quant(x, self.weight, self.eps, residual)
        return Fp8Rows(codes, scale, x.dtype), stream
