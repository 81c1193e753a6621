"""RMSNorm over rows, with an optional residual add fused in front.

    residual_out = x + residual            (rounded to the residual's dtype, as torch adds)
    out          = weight * (residual_out * rsqrt(mean(residual_out^2) + eps))

One program per row; the row is one block of the next power of two >= hidden (<= 64k).

`rms_norm_quant` is the same norm quantizing its output per token to FP8 for the W8A8 GEMM
behind it (`fp8_quant.per_token_quant` of `rms_norm`'s output, bit for bit: the normed row is
rounded to the model dtype first), so the 16-bit normed rows are never written.
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

MAX_HIDDEN = 65536


@triton.jit
def _add_norm_row(X, RES, W, RES_OUT, row, stride_x, stride_res, stride_res_out, hidden, eps,
                  DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row's residual add (stored) and norm -> weight * normed in float32, to be rounded
    to DTYPE (the model dtype) by the caller; zero past `hidden`."""
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
    normed = (x * rstd).to(DTYPE).to(tl.float32)
    return normed * w


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = _add_norm_row(X, RES, W, RES_OUT, row, stride_x, stride_res, stride_res_out, hidden, eps,
                      OUT.dtype.element_ty, HAS_RESIDUAL, BLOCK)
    tl.store(OUT + row * stride_out + cols, y.to(OUT.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _rms_norm_quant_kernel(
    X, RES, W, OUT, SCALE, RES_OUT,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dtype = X.dtype.element_ty
    y = _add_norm_row(X, RES, W, RES_OUT, row, stride_x, stride_res, stride_res_out, hidden, eps,
                      dtype, HAS_RESIDUAL, BLOCK)
    y = y.to(dtype).to(tl.float32)  # what rms_norm stores and per_token_quant reads back
    scale = token_scale(tl.max(tl.abs(y), 0), FP8_MAX_C, MIN_SCALE_C)
    tl.store(SCALE + row, scale)
    q = fp8_codes(y, scale, FP8_MAX_C)
    tl.store(OUT + row * stride_out + cols, q.to(OUT.dtype.element_ty), mask=cols < hidden)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [tokens, hidden], rows contiguous"
    assert x.shape[1] <= MAX_HIDDEN and weight.shape == (x.shape[1],)
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] (last dim contiguous) -> normed [tokens, hidden] in x's dtype; with
    `residual` (same shape) -> (normed, x + residual), both new tensors (the inputs stay intact,
    so a caller's embeddings are never overwritten)."""
    _check(x, weight, residual)
    tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res, res_out = x, out  # unused
    else:
        res, res_out = residual, torch.empty(x.shape, dtype=residual.dtype,
                                                  device=x.device)
    if tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(tokens,)](
            x, res, weight, out, res_out,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
            **pdl_args(x.device),
        )
    return out if residual is None else (out, res_out)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`per_token_quant(rms_norm(x, weight, eps, residual))` in one kernel: x [tokens, hidden]
    -> (FP8 codes [tokens, hidden], float32 scales [tokens, 1], x + residual: a new tensor, or
    None without `residual`)."""
    _check(x, weight, residual)
    tokens, hidden = x.shape
    out, scale = empty_quantized(tokens, hidden, x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=residual.dtype,
                                                        device=x.device)
    if tokens:
        block = triton.next_power_of_2(hidden)  # rms_norm's block and warps: the same sum order
        res = x if residual is None else residual
        res_arg = out if res_out is None else res_out  # unused without a residual
        _rms_norm_quant_kernel[(tokens,)](
            x, res, weight, out, scale, res_arg,
            x.stride(0), res.stride(0), out.stride(0), res_arg.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, num_warps=_num_warps(block),
            **pdl_args(x.device),
        )
    return out, scale, res_out
