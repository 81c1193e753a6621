"""Per-token FP8 quantization of activations in one kernel (torch needs five: abs, amax, div,
clamp, cast): x [M, K] -> (x_q [M, K] float8_e4m3fn, scale [M, 1] float32) with
scale = max(amax(|x row|) / 448, 1e-12) and x_q = saturate(x / scale), as
`models/layers/fp8.quantize_tokens` computes them. One program per row, two passes over K in
BLOCK-wide chunks (amax, then scale and store); no host sync, so CUDA graphs capture it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _per_token_quant_kernel(X, OUT, SCALE, K, stride_x, stride_out,
                            BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
                            MIN_SCALE_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(X + row * stride_x + k + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX_C, MIN_SCALE_C)
    tl.store(SCALE + row, scale)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(X + row * stride_x + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX_C), FP8_MAX_C)
        tl.store(OUT + row * stride_out + k + offs, q.to(OUT.dtype.element_ty), mask=mask)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (FP8 [M, K], float32 scales [M, 1])."""
    assert x.dim() == 2 and x.stride(-1) == 1
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(max(k, 16)), 2048)
        _per_token_quant_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0),
                                      BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                      num_warps=4 if block <= 1024 else 8)
    return out, scale
