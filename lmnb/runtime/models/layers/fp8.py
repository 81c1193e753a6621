"""FP8 (e4m3) weights with per-output-channel scales, and the GEMMs over them.

    weight        [N, K] float8_e4m3fn    w ~= weight * weight_scale[:, None]
    weight_scale  [N]    float32          amax of the row / 448 (or the checkpoint's)
    activations   per token, at run time: x ~= x_q * x_scale[:, None], x_scale = amax(row) / 448

`fp8_linear` picks one of three paths by rows M and device:
    M = 1 and fused     `kernels.fused.gemv_fp8`: the skinny Triton GEMM reading FP8 weights,
                        dequantized in registers (activations stay 16-bit: W8A16, what batch-1
                        decode needs; `W8A16_MAX_ROWS`)
    CUDA                W8A8 on the FP8 tensor cores with row-wise scales: up to
                        `W8A8_TRITON_MAX_ROWS` rows (more where `takes_triton_w8a8`)
                        `kernels.fused.mm_fp8.w8a8_mm` (Triton; K split over the SMs at
                        2-16 rows), else `torch._scaled_mm`;
                        the activations quantized by one Triton kernel when fused
    otherwise (CPU)     the reference: the same W8A8 math in float32 (FP8 products are exact in
                        float32; the activations quantized by that kernel, interpreted, when
                        fused), slow; the loader warns that the CPU runs FP8 this way
With `weight_only` (W8A16 checkpoints, `Fp8Config.weight_only`) the activations are never
quantized: M = 1 through the skinny kernel, more rows through `kernels.fused.mm_fp8.w8a16_mm`
when fused (FP8 weight tiles converted in registers; K split over the SMs at 2-16 rows), else
the weight dequantized to x's dtype and F.linear.

Decode's fusions (skinny rows only: batch 1; a launch there costs about what streaming 6 MB of
FP8 weights does, and a layer has 5 small kernels beside its 4 GEMMs):
    `fp8_silu_linear`   gate_up with SiLU-and-mul in the GEMM's epilogue
    `fp8_norm_linear`   RMSNorm (+ the residual add) in the GEMM's prologue: qkv after
                        input_layernorm, gate_up (+ SiLU) after post_attention_layernorm
    `fp8_norm_rotary_linear`  qkv's, with the rotary in the epilogue storing k and v in the
                        KV pool (the norm, qkv and rotary kernels in one)

The W8A8 paths' fusions (more rows: prefill, decode batches): the kernel in front emits
the per-token FP8 rows (`Fp8Rows`) instead of its 16-bit output (`rmsnorm.rms_norm_quant`,
`activation.silu_and_mul_quant`; `quantizes_tokens` says where a layer takes them) and
`fp8_rows_linear` runs the GEMM over them: the same codes and scales as quantizing that output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.nn import functional as F

from lmnb.runtime.kernels.multiprocessors import multiprocessors

if TYPE_CHECKING:
    from lmnb.runtime.kernels.fused.gemv_fp8 import RotaryStore

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
_MIN_SCALE = 1e-12  # all-zero rows: any positive scale gives zero back
SKINNY_MAX_ROWS = 16  # = kernels.fused.gemv.SKINNY_MAX_ROWS (not imported: triton is optional)
# Rows up to which fused FP8 layers take the skinny W8A16 kernel (batch-1 decode, with its
# fusions). Above it W8A8 layers quantize per token for the W8A8 GEMMs, and weight-only ones run
# `mm_fp8.w8a16_mm`; at 2-16 rows both on split-K tiles (`mm_fp8.decode_rows_config`), which read
# the weights faster than the skinny kernel's dot path (it converts every weight tile in
# registers). H200, random Llama-3-8B, decode at batch 2/4/8/16 (every linear on one path): the
# W8A8 GEMM 3.31/3.22/3.54/3.55 ms a step, the W8A16 one 3.25/3.25/3.56/3.56 (session 32), the
# skinny kernel 3.86/4.30/4.13/4.17 (`bench/fp8.py`'s "fp8-skinny-rows" variant sets
# SKINNY_MAX_ROWS back). Read when a forward runs (set it before a Runtime captures its graphs).
W8A16_MAX_ROWS = 1


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] 16/32-bit -> (FP8 [N, K], float32 scales [N]), one scale per row (output channel)."""
    w = weight.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 [N, K] and scales [N] -> [N, K] in `dtype`."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], float32 scales [M, 1]): per-token dynamic quantization."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def to_fp8_saturated(x: torch.Tensor) -> torch.Tensor:
    """x clamped to the FP8 range, then cast (torch's cast may give NaN past the range)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8Rows(NamedTuple):
    """Activations quantized per token, the W8A8 GEMM's input: x ~= codes * scale."""

    codes: torch.Tensor  # [M, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the model dtype x was in (the GEMM's output dtype)


def _quantize(x: torch.Tensor, fused: bool) -> Fp8Rows:
    if fused:  # one Triton kernel instead of five torch ops
        from lmnb.runtime.kernels.fused.fp8_quant import per_token_quant

        return Fp8Rows(*per_token_quant(x), x.dtype)
    return Fp8Rows(*quantize_tokens(x), x.dtype)


def _rows_reference(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 products accumulated in float32 (exact products), both scales applied to the sum."""
    out = (x.codes.float() @ weight.float().t()) * x.scale * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def scaled_mm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """What the `_scaled_mm` path computes, in float32 on any device: per-token FP8 activations
    times FP8 weights, accumulated in float32, both scales applied to the sum. x [M, K]."""
    return _rows_reference(_quantize(x, fused=False), weight, weight_scale, bias)


def _scaled_mm(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    # Row-wise scales need a bfloat16 output; weight.t() is the column-major [K, N] it wants.
    out = torch._scaled_mm(x.codes, weight.t(), scale_a=x.scale,
                           scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


def _scaled_mm_shapes(k: int, n: int) -> bool:
    return k % 16 == 0 and n % 16 == 0


def quantizes_tokens(rows: int, weight: torch.Tensor, device: torch.device, *, fused: bool,
                     weight_only: bool) -> bool:
    """Whether `fp8_linear` quantizes `rows` rows of input on `device` per token (W8A8: the
    Triton GEMM at its rows, any shape; `_scaled_mm` where K and N are multiples of 16; the
    reference off CUDA), so that it may take them as `Fp8Rows`."""
    if weight_only or rows <= 0 or (fused and rows <= W8A16_MAX_ROWS):
        return False
    if device.type != "cuda":
        return True
    n, k = weight.shape
    return takes_triton_w8a8(rows, n, multiprocessors(device) or 0) or _scaled_mm_shapes(k, n)


# Rows up to which CUDA's W8A8 GEMMs run the Triton kernel (`mm_fp8.w8a8_mm`, tiles that fill
# the SMs at a decode batch's rows) instead of `_scaled_mm`; 0: never. Read at each call. H200
# (`bench/w8a8_mm.py`, Llama-3-8B's linears): 1.16-1.46x `_scaled_mm` at 17-64 rows; at 128
# o/down 1.16-1.27x, qkv 1.0x, but gate_up 0.85x or less with every tile swept; past 128 rows
# 0.63-1.12x (the best tile of each).
W8A8_TRITON_MAX_ROWS = 64
# Past those rows and up to these, the Triton kernel still takes a weight whose 128 x 128 tiles
# (cuBLASLt's at these rows) would leave more than half the SMs idle: Llama-3-8B's qkv, o and
# down at 65-128 rows, not gate_up.
W8A8_TRITON_SPARSE_GRID_MAX_ROWS = 128


def takes_triton_w8a8(rows: int, columns: int, multiprocessors: int) -> bool:
    """Whether `fp8_rows_linear` runs `rows` x `columns` through `mm_fp8.w8a8_mm` on a GPU of
    `multiprocessors` SMs rather than `_scaled_mm`."""
    if rows <= W8A8_TRITON_MAX_ROWS:
        return True
    if rows > W8A8_TRITON_SPARSE_GRID_MAX_ROWS:
        return False
    return 2 * (-(-rows // 128)) * (-(-columns // 128)) < multiprocessors


def fp8_rows_linear(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear`'s W8A8 GEMM over rows already quantized (where `quantizes_tokens`):
    x [M, K] -> [M, N] in x.dtype; on CUDA `mm_fp8.w8a8_mm` where `takes_triton_w8a8`,
    `_scaled_mm` elsewhere; the float32 reference off CUDA."""
    if x.codes.is_cuda:
        sms = multiprocessors(x.codes.device) or 0
        if takes_triton_w8a8(x.codes.shape[0], weight.shape[0], sms):
            from lmnb.runtime.kernels.fused.mm_fp8 import w8a8_mm

            return w8a8_mm(x.codes, x.scale, weight, weight_scale, bias, x.dtype)
        return _scaled_mm(x, weight, weight_scale, bias)
    return _rows_reference(x, weight, weight_scale, bias)


def skinny_rows(x: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether x [..., K] has few enough rows (1..max_rows, by default `W8A16_MAX_ROWS`) for
    the skinny kernels."""
    limit = W8A16_MAX_ROWS if max_rows is None else max_rows
    return 1 <= x.numel() // max(x.shape[-1], 1) <= limit


# The RMSNorm prologue (and qkv's rotary epilogue with it) only for one row: over 2-16 rows the
# skinny kernel's dot path re-reads every row of x, the residual and the norm weight from L2 in
# each program and normalises them again, and the fused kernels are slower than their parts
# (H200, `python bench/gemv.py --fp8 --rows 1 2 4 8 16`: Llama-3-8B's qkv 36 us fused against
# 15-17 us apart, gate_up 112-115 against 39; at one row 10.9 against 10.5 and 29.3 against 30.8).
NORM_PROLOGUE_MAX_ROWS = 1


def norm_prologue_rows(x: torch.Tensor) -> bool:
    """Whether x [..., K] has few enough rows for the skinny kernel's RMSNorm prologue."""
    return skinny_rows(x, NORM_PROLOGUE_MAX_ROWS)


def fp8_silu_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up for gate_up's FP8 weight [gate (I rows) | up (I rows), K]: x [..., K]
    (`skinny_rows`) -> [..., I] in x's dtype, through the skinny kernel with the activation
    fused (`fp8_gemv(..., gated=True)`); the same numbers as `fp8_linear` then SiLU-and-mul."""
    from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv

    k = x.shape[-1]
    out = fp8_gemv(x.reshape(-1, k).contiguous(), weight, weight_scale, bias, gated=True)
    return out.view(*x.shape[:-1], weight.shape[0] // 2)


def fp8_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, *, gated: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + residual) -> the FP8 linear (-> silu(gate) * up when `gated`), x [..., K]
    (`skinny_rows`), one kernel -> (out [..., N or N/2], x + residual: the residual stream;
    x itself without a residual). `gemv_fp8.fp8_norm_gemv`."""
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, fp8_norm_gemv

    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    res = None if residual is None else residual.reshape(-1, k)
    out, stream = fp8_norm_gemv(rows, RmsNormInput(res, norm_weight, eps), weight, weight_scale,
                                bias, gated=gated)
    n = weight.shape[0] // (2 if gated else 1)
    return (out.view(*x.shape[:-1], n),
            x if residual is None else stream.view(x.shape))


def fp8_norm_rotary_linear(x: torch.Tensor, residual: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
                           rope: RotaryStore) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_norm_linear` of qkv with the neox rotary in the epilogue: x [tokens, K]
    (`skinny_rows`) -> (q [tokens, heads * head_dim], the residual stream); k and v go to
    `rope.k_buffer` / `rope.v_buffer` at `rope.slots` (`gemv_fp8.fp8_norm_gemv(..., rope=)`)."""
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, fp8_norm_gemv

    out, stream = fp8_norm_gemv(x.contiguous(), RmsNormInput(residual, norm_weight, eps),
                                weight, weight_scale, bias, rope=rope)
    return out, x if residual is None else stream


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, *, fused: bool, weight_only: bool = False
               ) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T + bias -> [..., N] in x's dtype (paths above)."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    n = weight.shape[0]
    x2 = x.reshape(rows, k)
    if fused and 1 <= rows <= W8A16_MAX_ROWS:
        from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv

        out = fp8_gemv(x2.contiguous(), weight, weight_scale, bias)
    elif fused and rows > 0 and weight_only:
        from lmnb.runtime.kernels.fused.mm_fp8 import w8a16_mm

        out = w8a16_mm(x2.contiguous(), weight, weight_scale, bias)
    elif weight_only:
        out = F.linear(x2, dequantize_rows(weight, weight_scale, x.dtype), bias)
    elif rows > 0 and quantizes_tokens(rows, weight, x.device, fused=fused, weight_only=False):
        # _scaled_mm on CUDA, the reference elsewhere (its quantization in Triton's interpreter
        # when fused, as the kernels feeding `fp8_rows_linear` there quantize)
        out = fp8_rows_linear(_quantize(x2.contiguous(), fused), weight, weight_scale, bias)
    else:  # no rows, or shapes _scaled_mm refuses past the Triton GEMM's rows: dequantized
        out = F.linear(x2, dequantize_rows(weight, weight_scale, x.dtype), bias)
    return out.view(*x.shape[:-1], n)
