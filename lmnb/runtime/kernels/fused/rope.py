"""Neox rotary embedding of q and k in one launch, read straight from the qkv projection.

    qkv [tokens, (heads + 2 * kv_heads) * head_dim]    q heads | k heads | v heads, per token
    cos, sin [max_positions, >= head_dim / 2] float32  cos/sin of position * inv_freq (neox: the
                                                       second half of a head repeats the first)
    q_out[t, h] = (x1 cos - x2 sin | x2 cos + x1 sin)  for x = q[t, h] = (x1 | x2), the same for k

q goes to a new contiguous [tokens, heads * head_dim]. k goes either to a new [tokens, kv_heads *
head_dim], or, given the layer's KV buffers and the tokens' slots, straight to
`k_buffer[slots[t]]`, with v copied to `v_buffer[slots[t]]` (the attention backend then skips
its own store). One program per token covers all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous
from lmnb.runtime.memory.kv_storage import fixed_fp8_scales


@triton.jit
def rotate(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in float32 with explicit FMAs, so that every kernel
    rotating (this one, the qkv GEMV's epilogue: `gemv_rotary.py`) rounds alike whatever the
    compiler would contract."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(SRC, DST, dst_head_stride, cos, sin, offs, mask_d, num_heads,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & mask_d[None, :]
    src = SRC + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = DST + heads[:, None] * dst_head_stride + offs[None, :]
    y1, y2 = rotate(x1, x2, cos, sin)
    tl.store(dst, y1.to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def fp8_rows(x1, x2, FP8_MAX: tl.constexpr):
    """Rows (x1 | x2) [rows, half] float32 -> (x1, x2) divided by their row's scale and clamped
    to +-FP8_MAX (cast to e4m3 by the store), scale [rows] = amax / FP8_MAX (`KVStorage`'s
    rounding; the qkv GEMV's FP8 store, `gemv_rotary.py`, calls this too: the same bytes)."""
    amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
    scale = tl.maximum(amax / FP8_MAX, 1e-12)
    x1 = tl.clamp(x1 / scale[:, None], -FP8_MAX, FP8_MAX)
    return x1, tl.clamp(x2 / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def fixed_fp8_rows(x1, x2, scale, FP8_MAX: tl.constexpr):
    """Rows (x1 | x2) [rows, half] float32 divided by a pool's fixed scale [rows] and clamped
    to +-FP8_MAX (`kv_storage.quantize_fixed`)."""
    x1 = tl.clamp(x1 / scale[:, None], -FP8_MAX, FP8_MAX)
    return x1, tl.clamp(x2 / scale[:, None], -FP8_MAX, FP8_MAX)


@triton.jit
def _scaled_fp8(x1, x2, mask_h, SCALE, FP8_MAX: tl.constexpr, FIXED_SCALES: tl.constexpr):
    """Rows (x1 | x2) [heads, half] divided by their scale amax / FP8_MAX, stored at SCALE[h];
    FIXED_SCALES: by the pool's fixed scale read there."""
    if FIXED_SCALES:
        return fixed_fp8_rows(x1, x2, tl.load(SCALE, mask=mask_h, other=1.0), FP8_MAX)
    x1, x2, scale = fp8_rows(x1, x2, FP8_MAX)
    tl.store(SCALE, scale, mask=mask_h)
    return x1, x2


@triton.jit
def _rotary_qkv_kernel(
    QKV, POS, COS, SIN, Q_OUT, K_OUT, V_OUT, K_SCALE, V_SCALE, SLOTS,
    stride_qkv, stride_cos, stride_sin, stride_q_out,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_st, stride_sh,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, STORE_KV: tl.constexpr,
    KV_FP8: tl.constexpr = False, FIXED_SCALES: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0, USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    cos = tl.load(COS + pos * stride_cos + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + pos * stride_sin + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    row = QKV + token * stride_qkv
    _rotate_heads(row, Q_OUT + token * stride_q_out, HEAD_DIM, cos, sin, offs, mask_d,
                  num_heads, HEAD_DIM, HALF, BLOCK_H)
    k_src = row + num_heads * HEAD_DIM
    if STORE_KV:
        slot = tl.load(SLOTS + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_KV)
        mask_h = heads < num_kv_heads
        mask = mask_h[:, None] & mask_d[None, :]
        src = k_src + heads[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        k1, k2 = rotate(x1, x2, cos, sin)
        v_src = src + num_kv_heads * HEAD_DIM
        v1 = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0).to(tl.float32)
        if KV_FP8:  # one scale per (token, KV head), beside the pool (`KVStorage`), or fixed
            at = slot * stride_st + heads * stride_sh
            k1, k2 = _scaled_fp8(k1, k2, mask_h, K_SCALE + at, FP8_MAX, FIXED_SCALES)
            v1, v2 = _scaled_fp8(v1, v2, mask_h, V_SCALE + at, FP8_MAX, FIXED_SCALES)
        k_dst = K_OUT + slot * stride_k_row + heads[:, None] * stride_k_head + offs[None, :]
        tl.store(k_dst, k1.to(K_OUT.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF, k2.to(K_OUT.dtype.element_ty), mask=mask)
        v_dst = V_OUT + slot * stride_v_row + heads[:, None] * stride_v_head + offs[None, :]
        tl.store(v_dst, v1.to(V_OUT.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF, v2.to(V_OUT.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_src, K_OUT + token * stride_k_row, stride_k_head, cos, sin, offs,
                      mask_d, num_kv_heads, HEAD_DIM, HALF, BLOCK_KV)


def rotary_qkv(positions: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               *, num_heads: int, num_kv_heads: int, head_dim: int,
               kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
               slots: torch.Tensor | None = None,
               kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q [tokens, heads * head_dim], k [tokens, kv_heads * head_dim]) rotated, in qkv's dtype.

    With `kv_buffers` = (k_buffer, v_buffer) [slots, kv_heads, head_dim] and `slots` [tokens],
    the rotated k and the v of token t go to row slots[t] of those buffers (in their dtype)
    instead, and the returned k is None. FP8 buffers need `kv_scales` (k_scales, v_scales)
    [slots, kv_heads] float32 (any strides, the same for both; `KVStorage`'s are head-major):
    each (token, head) row is stored divided by amax / 448 and that scale goes to its entry, or,
    where they are a pool's fixed scales (`kv_storage.fixed_fp8_scales`), divided by its entry."""
    tokens = qkv.shape[0]
    assert head_dim % 2 == 0, "neox rotary needs an even head_dim"
    assert qkv.dim() == 2 and qkv.stride(-1) == 1
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.shape[-1] >= head_dim // 2
    q = torch.empty((tokens, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if kv_buffers is None:
        k = torch.empty((tokens, num_kv_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
        k_out = v_out = k.view(tokens, num_kv_heads, head_dim)  # v_out unused
        slots = positions  # unused
    else:
        assert slots is not None and slots.shape[0] == tokens
        k, (k_out, v_out) = None, kv_buffers
        assert k_out.stride(-1) == 1 and v_out.stride(-1) == 1
        assert k_out.shape[1:] == (num_kv_heads, head_dim) == v_out.shape[1:]
    kv_fp8 = k_out.dtype == torch.float8_e4m3fn
    assert not kv_fp8 or kv_scales is not None, "an FP8 pool needs its scales"
    k_scale, v_scale = kv_scales if kv_fp8 else (positions, positions)  # unread without FP8
    assert not kv_fp8 or k_scale.stride() == v_scale.stride(), "K and V scales share strides"
    if tokens:
        block_h = triton.next_power_of_2(num_heads)
        _rotary_qkv_kernel[(tokens,)](
            qkv, positions, cos, sin, q, k_out, v_out, k_scale, v_scale, slots,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
            k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
            *(k_scale.stride() if kv_fp8 else (0, 0)),
            num_heads, num_kv_heads,
            HEAD_DIM=head_dim, HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            STORE_KV=kv_buffers is not None, KV_FP8=kv_fp8,
            FIXED_SCALES=kv_fp8 and fixed_fp8_scales(k_scale),
            num_warps=4 if block_h * head_dim <= 2048 else 8, **pdl_args(q.device),
        )
    return q, k
