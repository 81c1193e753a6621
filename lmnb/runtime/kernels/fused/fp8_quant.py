"""Per-token FP8 quantization of activations in one kernel (torch needs five: abs, amax, div,
clamp, cast): x [M, K] -> (x_q [M, K] float8_e4m3fn, scale [M, 1] float32) with
scale = max(amax(|x row|) / 448, 1e-12) and x_q = saturate(x / scale), as
`models/layers/fp8.quantize_tokens` computes them. One program per row, two passes over K in
BLOCK-wide chunks (amax, then scale and store); no host sync, so CUDA graphs capture it.

`token_scale` and `fp8_codes` are that math for the kernels that quantize the row they compute
(`rmsnorm.rms_norm_quant`, `activation.silu_and_mul_quant`): the same operations, so the same
codes and scales as this kernel over their 16-bit output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def token_scale(amax, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """The row's float32 scale from its amax (a float32 scalar)."""
    return tl.maximum(amax / FP8_MAX_C, MIN_SCALE_C)


@triton.jit
def fp8_codes(x, scale, FP8_MAX_C: tl.constexpr):
    """float32 x / scale, saturated to the FP8 range (the caller casts it to the FP8 dtype)."""
    return tl.minimum(tl.maximum(x / scale, -FP8_MAX_C), FP8_MAX_C)


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
    scale = token_scale(tl.max(amax, 0), FP8_MAX_C, MIN_SCALE_C)
    tl.store(SCALE + row, scale)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(X + row * stride_x + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = fp8_codes(x, scale, FP8_MAX_C)
        tl.store(OUT + row * stride_out + k + offs, q.to(OUT.dtype.element_ty), mask=mask)


def empty_quantized(m: int, k: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] float8_e4m3fn, scales [m, 1] float32), uninitialised."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (FP8 [M, K], float32 scales [M, 1])."""
    assert x.dim() == 2 and x.stride(-1) == 1
    m, k = x.shape
    out, scale = empty_quantized(m, k, x.device)
    if m:
        block = min(triton.next_power_of_2(max(k, 16)), 2048)
        _per_token_quant_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0),
                                      BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                      num_warps=4 if block <= 1024 else 8)
    return out, scale
