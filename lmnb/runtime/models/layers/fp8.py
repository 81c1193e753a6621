"""FP8 (e4m3) weights with per-output-channel scales, and the GEMMs over them.

    weight        [N, K] float8_e4m3fn    w ~= weight * weight_scale[:, None]
    weight_scale  [N]    float32          amax of the row / 448 (or the checkpoint's)
    activations   per token, at run time: x ~= x_q * x_scale[:, None], x_scale = amax(row) / 448

`fp8_linear` picks one of three paths by rows M and device:
    M <= 16 and fused   `kernels.fused.gemv_fp8`: the skinny Triton GEMM reading FP8 weights,
                        dequantized in registers (activations stay 16-bit: W8A16, what batch-1
                        decode needs)
    CUDA                `torch._scaled_mm` (FP8 tensor cores, W8A8) with row-wise scales, the
                        activations quantized by one Triton kernel when fused
    otherwise (CPU)     the reference: the same W8A8 math in float32 (FP8 products are exact in
                        float32), slow; the loader warns that the CPU runs FP8 this way
With `weight_only` (W8A16 checkpoints, `Fp8Config.weight_only`) the activations are never
quantized: M <= 16 as above, more rows through `kernels.fused.mm_fp8.w8a16_mm` when fused (FP8
weight tiles converted in registers), else the weight dequantized to x's dtype and F.linear.

Decode's fusions (skinny rows only; at batch 1 a launch costs about what streaming 6 MB of
FP8 weights does, and a layer has 5 small kernels beside its 4 GEMMs):
    `fp8_silu_linear`   gate_up with SiLU-and-mul in the GEMM's epilogue
    `fp8_norm_linear`   RMSNorm (+ the residual add) in the GEMM's prologue: qkv after
                        input_layernorm, gate_up (+ SiLU) after post_attention_layernorm
    `fp8_norm_rotary_linear`  qkv's, with the rotary in the epilogue storing k and v in the
                        KV pool (the norm, qkv and rotary kernels in one)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from lmnb.runtime.kernels.fused.gemv_fp8 import RotaryStore

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
_MIN_SCALE = 1e-12  # all-zero rows: any positive scale gives zero back
SKINNY_MAX_ROWS = 16  # = kernels.fused.gemv.SKINNY_MAX_ROWS (not imported: triton is optional)


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


def scaled_mm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """What the `_scaled_mm` path computes, in float32 on any device: per-token FP8 activations
    times FP8 weights, accumulated in float32, both scales applied to the sum. x [M, K]."""
    x_q, x_scale = quantize_tokens(x)
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    if fused:  # one Triton kernel instead of five torch ops
        from lmnb.runtime.kernels.fused.fp8_quant import per_token_quant

        x_q, x_scale = per_token_quant(x)
    else:
        x_q, x_scale = quantize_tokens(x)
    # Row-wise scales need a bfloat16 output; weight.t() is the column-major [K, N] it wants.
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale,
                           scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


def skinny_rows(x: torch.Tensor) -> bool:
    """Whether x [..., K] has few enough rows (1..SKINNY_MAX_ROWS) for the skinny kernels."""
    return 1 <= x.numel() // max(x.shape[-1], 1) <= SKINNY_MAX_ROWS


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
    if fused and 1 <= rows <= SKINNY_MAX_ROWS:
        from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv

        out = fp8_gemv(x2.contiguous(), weight, weight_scale, bias)
    elif weight_only and fused and rows > 0:
        from lmnb.runtime.kernels.fused.mm_fp8 import w8a16_mm

        out = w8a16_mm(x2.contiguous(), weight, weight_scale, bias)
    elif weight_only:
        out = F.linear(x2, dequantize_rows(weight, weight_scale, x.dtype), bias)
    elif x.is_cuda and rows > 0 and k % 16 == 0 and n % 16 == 0:
        out = _scaled_mm(x2.contiguous(), weight, weight_scale, bias, fused)
    elif x.is_cuda:  # shapes _scaled_mm refuses (tiny test models): dequantized weights
        out = F.linear(x2, dequantize_rows(weight, weight_scale, x.dtype), bias)
    else:
        out = scaled_mm_reference(x2, weight, weight_scale, bias)
    return out.view(*x.shape[:-1], n)
