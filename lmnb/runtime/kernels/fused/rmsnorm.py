"""RMSNorm over rows, with an optional residual add fused in front.

    residual_out = x + residual            (rounded to the residual's dtype, as torch adds)
    out          = weight * (residual_out * rsqrt(mean(residual_out^2) + eps))

One program per row; the row is one block of the next power of two >= hidden (<= 64k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    # torch path: normalised in fp32, rounded to the model dtype, then times the weight
    normed = (x * rstd).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (normed * w).to(OUT.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] (last dim contiguous) -> normed [tokens, hidden] in x's dtype; with
    `residual` (same shape) -> (normed, x + residual), both new tensors (the inputs stay intact,
    so a caller's embeddings are never overwritten)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [tokens, hidden], rows contiguous"
    tokens, hidden = x.shape
    assert hidden <= MAX_HIDDEN and weight.shape == (hidden,)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res, res_out = x, out  # unused
    else:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        res, res_out = residual, torch.empty(x.shape, dtype=residual.dtype,
                                                  device=x.device)
    if tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(tokens,)](
            x, res, weight, out, res_out,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    return out if residual is None else (out, res_out)
