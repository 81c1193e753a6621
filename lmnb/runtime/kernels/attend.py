"""One online-softmax step of a tile of query rows over a block of KV columns of the token-level
pool, shared by the extend, decode and shared-prefix attention kernels.

Over an FP8 pool the dots multiply float16: e4m3 converts to float16 in one instruction a pair
(`cvt.rn.f16x2.e4m3x2`), to bfloat16 in three more a value. 16-bit q enters as float16 rows
scaled to |q| <= 1 (`fp8_pool_query`: float16's range holds any q, its 10-bit mantissa keeps
more than bfloat16's 7), and the probabilities times V's scales as float16 normalised by the
block's largest scale (no underflow of small scales). V's rows are read as int32 words and
converted where loaded (`e4m3_words`), so the dot's transposing layout change moves 16-bit
values, not bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_operand
from lmnb.runtime.kernels.e4m3_words import e4m3x4
from lmnb.runtime.kernels.interpreter import INTERPRETED

_ASM_CVT = tl.constexpr(not INTERPRETED)


def fp8_pool_compute(q_dtype: torch.dtype) -> torch.dtype:
    """What the dots multiply over an FP8 pool for q of `q_dtype` (`fp8_pool_query`)."""
    return torch.float32 if q_dtype == torch.float32 else torch.float16


@triton.jit
def fp8_pool_query(q):
    """q [rows, head_dim] for the dots over an FP8 pool -> (q', row_scale [rows] float32) with
    q = q' * row_scale: 16-bit q as float16 scaled to |q'| <= 1; float32 q as it is."""
    if q.dtype == tl.float32:
        return q, tl.full([q.shape[0]], 1.0, dtype=tl.float32)
    else:
        q32 = q.to(tl.float32)
        top = tl.max(tl.abs(q32), 1)
        top = tl.where(top > 0, top, 1.0)
        return (q32 / top[:, None]).to(tl.float16), top


@triton.jit
def _fp8_rows_f16(V, slots, kv_head, stride_vt, stride_vh, mask_n, BLOCK_D: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """V's FP8 rows [BLOCK_N, BLOCK_D] of `slots` as float16, converted where they were loaded
    (four to an int32 word; rows of HEAD_DIM, a multiple of 4)."""
    tl.static_assert(HEAD_DIM > 0 and HEAD_DIM % 4 == 0, "an FP8 pool's V needs HEAD_DIM")
    words = V.to(tl.pointer_type(tl.int32))
    offs_w = tl.arange(0, BLOCK_D // 4)
    w = tl.load(words + slots[:, None] * (stride_vt // 4) + kv_head * (stride_vh // 4)
                + offs_w[None, :], mask=mask_n[:, None] & (offs_w < HEAD_DIM // 4)[None, :],
                other=0)
    v0, v1, v2, v3 = e4m3x4(w, tl.float16, _ASM_CVT)
    v = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [n, j, a, b] = v_{2a+b}: column 4j + 2a + b
    return tl.reshape(v, (slots.shape[0], BLOCK_D))


@triton.jit
def attend_block(q, K, V, SLOTS, n, end, last, m_i, l_i, acc, scale, kv_head,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                  V_SCALE=None, stride_st=0, q_scale=None,
                 HEAD_DIM: tl.constexpr = 0):
    """One online-softmax step of q's rows over KV columns n : n + BLOCK_N (those < end) whose
    slots are SLOTS[n:]; with CAUSAL, row r sees columns <= last[r]. KV_FP8: K/V are FP8,
    dequantized to q's dtype, with this KV head's scales of slot s at K_SCALE + s * stride_st
    (V_SCALE likewise), q given by `fp8_pool_query` with its rows' `q_scale`, rows of HEAD_DIM.
    K_ROWS: see `attend_slots`."""
    cols = n + offs_n
    mask_n = cols < end
    slots = tl.load(SLOTS + cols, mask=mask_n, other=0)
    return attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                        CAUSAL, PRECISION, UPCAST, KV_FP8, K_ROWS, K_SCALE, V_SCALE, stride_st,
                        q_scale, HEAD_DIM)


@triton.jit
def attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                 stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                 V_SCALE=None, stride_st=0, q_scale=None,
                 HEAD_DIM: tl.constexpr = 0):
    """`attend_block` with the block's slots [BLOCK_N] (and its column positions `cols`, valid
    where mask_n) already loaded. K_ROWS: K is loaded token-major and transposed for the dot."""
    if K_ROWS:
        k = tl.trans(tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh
                             + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                             other=0.0))  # [BLOCK_D, BLOCK_N]
    else:
        k = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    if KV_FP8:
        k_scale = tl.load(K_SCALE + slots * stride_st, mask=mask_n, other=1.0)
        v_scale = tl.load(V_SCALE + slots * stride_st, mask=mask_n, other=0.0)
        k = k.to(q.dtype)
    qk = tl.dot(q, dot_operand(k, UPCAST), input_precision=PRECISION)
    if KV_FP8:
        qk = qk * q_scale[:, None] * (k_scale * scale)[None, :]
    else:
        qk = qk * scale
    if CAUSAL:
        qk = tl.where(mask_n[None, :] & (cols[None, :] <= last[:, None]), qk, float("-inf"))
    else:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    if KV_FP8 and q.dtype == tl.float16:
        v = _fp8_rows_f16(V, slots, kv_head, stride_vt, stride_vh, mask_n, offs_d.shape[0],
                          HEAD_DIM)
    else:
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if KV_FP8:
        v = v.to(q.dtype)
        v_top = tl.maximum(tl.max(v_scale, 0), 1e-30)
        pv = tl.dot((p * (v_scale / v_top)[None, :]).to(q.dtype), dot_operand(v, UPCAST),
                    input_precision=PRECISION) * v_top
    else:
        v = dot_operand(v, UPCAST)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i * alpha + tl.sum(p, 1), acc
