"""SiLU-and-mul: x = [gate | up] (the gate_up projection's two halves) -> silu(gate) * up.

Programs over (token, block of the intermediate size); silu rounds to the model dtype before the
product, as the torch path (`act(gate) * up`) does. `silu_mul` is the same math for kernels that
fuse it into their epilogue (the FP8 gate_up GEMM, `gemv_fp8.fp8_gemv(..., gated=True)`).

`silu_and_mul_quant` quantizes the product per token to FP8 for the W8A8 down projection
(`fp8_quant.per_token_quant` of `silu_and_mul`'s output, bit for bit), one program per token:
the whole row in registers up to ROW_BLOCK_MAX, else two passes over it (amax, then the codes;
the second recomputes the product from the input, mostly in L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.fused.fp8_quant import (
    FP8_MAX,
    MIN_SCALE,
    empty_quantized,
    fp8_codes,
    token_scale,
)
from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous

BLOCK = 1024
ROW_BLOCK_MAX = 16384  # Llama-3-8B's 14336 features in one block
CHUNK = 4096  # wider rows: two passes in chunks of this


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """float32 gate and up (already rounded to DTYPE) -> silu(gate) * up in float32, rounded to
    DTYPE where the torch path rounds (after silu, after the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (act * up).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_mul_at(X_ROW, cols, width, DTYPE: tl.constexpr):
    """`silu_mul` of the gate | up row at X_ROW (gate at cols, up at width + cols) for the
    columns cols < width; zero past them."""
    mask = cols < width
    gate = tl.load(X_ROW + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X_ROW + width + cols, mask=mask, other=0.0).to(tl.float32)
    return silu_mul(gate, up, DTYPE)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_out, width, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    out = _silu_mul_at(X + row * stride_x, cols, width, OUT.dtype.element_ty)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=cols < width)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * width] (last dim contiguous) -> [tokens, width] in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, BLOCK))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=BLOCK, num_warps=4,
            **pdl_args(x.device))
    return out


@triton.jit
def _silu_and_mul_quant_kernel(X, OUT, SCALE, stride_x, stride_out, width,
                               BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                               FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                               USE_PDL: tl.constexpr = False):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    dtype = X.dtype.element_ty
    x_row = X + row * stride_x
    if ONE_BLOCK:
        act = _silu_mul_at(x_row, offs, width, dtype)  # zero past width
        scale = token_scale(tl.max(tl.abs(act), 0), FP8_MAX_C, MIN_SCALE_C)
        tl.store(SCALE + row, scale)
        q = fp8_codes(act, scale, FP8_MAX_C)
        tl.store(OUT + row * stride_out + offs, q.to(OUT.dtype.element_ty), mask=offs < width)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, width, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul_at(x_row, k + offs, width, dtype)))
        scale = token_scale(tl.max(amax, 0), FP8_MAX_C, MIN_SCALE_C)
        tl.store(SCALE + row, scale)
        for k in range(0, width, BLOCK):
            q = fp8_codes(_silu_mul_at(x_row, k + offs, width, dtype), scale, FP8_MAX_C)
            tl.store(OUT + row * stride_out + k + offs, q.to(OUT.dtype.element_ty),
                     mask=k + offs < width)


def silu_and_mul_quant(x: torch.Tensor, *, row_block_max: int = ROW_BLOCK_MAX
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_token_quant(silu_and_mul(x))` in one kernel: x [tokens, 2 * width] (last dim
    contiguous) -> (FP8 codes [tokens, width], float32 scales [tokens, 1]). Rows wider than
    `row_block_max` take the two-pass loop (tests lower it to reach that loop at tiny sizes)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    tokens, width = x.shape[0], x.shape[1] // 2
    out, scale = empty_quantized(tokens, width, x.device)
    if tokens:
        one_block = width <= row_block_max
        block = triton.next_power_of_2(max(width, 16) if one_block else min(CHUNK, row_block_max))
        _silu_and_mul_quant_kernel[(tokens,)](
            x, out, scale, x.stride(0), out.stride(0), width, BLOCK=block, ONE_BLOCK=one_block,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
            **pdl_args(x.device))
    return out, scale
