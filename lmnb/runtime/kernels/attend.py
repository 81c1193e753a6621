"""One online-softmax step of a tile of query rows over a block of KV columns of the token-level
pool, shared by the extend, decode and shared-prefix attention kernels.

Over an FP8 pool the dots multiply float16: e4m3 converts to float16 in one instruction a pair
(`cvt.rn.f16x2.e4m3x2`) but to bfloat16 in three more a value, which bound the kernel, not the
bytes. So 16-bit q enters as float16 rows scaled to |q| <= 1 (`fp8_pool_query`: float16's range
holds any q, its 10-bit mantissa keeps more than bfloat16's 7), and the probabilities times V's
scales as float16 normalised by the block's largest scale (no underflow of small scales)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_operand


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
def attend_block(q, K, V, SLOTS, n, end, last, m_i, l_i, acc, scale, kv_head,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                  V_SCALE=None, stride_st=0, q_scale=None):
    """One online-softmax step of q's rows over KV columns n : n + BLOCK_N (those < end) whose
    slots are SLOTS[n:]; with CAUSAL, row r sees columns <= last[r]. KV_FP8: K/V are FP8,
    dequantized to q's dtype, with this KV head's scales of slot s at K_SCALE + s * stride_st
    (V_SCALE likewise), q given by `fp8_pool_query` with its rows' `q_scale`. K_ROWS: see
    `attend_slots`."""
    cols = n + offs_n
    mask_n = cols < end
    slots = tl.load(SLOTS + cols, mask=mask_n, other=0)
    return attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                        CAUSAL, PRECISION, UPCAST, KV_FP8, K_ROWS, K_SCALE, V_SCALE, stride_st,
                        q_scale)


@triton.jit
def attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                 stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                 V_SCALE=None, stride_st=0, q_scale=None):
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
