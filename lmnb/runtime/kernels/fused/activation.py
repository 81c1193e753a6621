"""SiLU-and-mul: x = [gate | up] (the gate_up projection's two halves) -> silu(gate) * up.

Programs over (token, block of the intermediate size); silu rounds to the model dtype before the
product, as the torch path (`act(gate) * up`) does. `silu_mul` is the same math for kernels that
fuse it into their epilogue (the FP8 gate_up GEMM, `gemv_fp8.fp8_gemv(..., gated=True)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """float32 gate and up (already rounded to DTYPE) -> silu(gate) * up in float32, rounded to
    DTYPE where the torch path rounds (after silu, after the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (act * up).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up, OUT.dtype.element_ty)
    tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * width] (last dim contiguous) -> [tokens, width] in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, BLOCK))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=BLOCK, num_warps=4)
    return out
