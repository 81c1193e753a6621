"""SiLU-and-mul: x = [gate | up] (the gate_up projection's two halves) -> silu(gate) * up.

Programs over (token, block of the intermediate size); silu rounds to the model dtype before the
product, as the torch path (`act(gate) * up`) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * width] (last dim contiguous) -> [tokens, width] in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, BLOCK))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=BLOCK, num_warps=4)
    return out
