"""One online-softmax step of a tile of query rows over a block of KV columns of the token-level
pool, shared by the extend, decode and shared-prefix attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_operand


@triton.jit
def attend_block(q, K, V, SLOTS, n, end, last, m_i, l_i, acc, scale, kv_head,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                  V_SCALE=None, stride_st=0):
    """One online-softmax step of q's rows over KV columns n : n + BLOCK_N (those < end) whose
    slots are SLOTS[n:]; with CAUSAL, row r sees columns <= last[r]. KV_FP8: K/V are FP8,
    dequantized to q's dtype, with this KV head's scales of slot s at K_SCALE + s * stride_st
    (V_SCALE likewise). K_ROWS: see `attend_slots`."""
    cols = n + offs_n
    mask_n = cols < end
    slots = tl.load(SLOTS + cols, mask=mask_n, other=0)
    return attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                        CAUSAL, PRECISION, UPCAST, KV_FP8, K_ROWS, K_SCALE, V_SCALE, stride_st)


@triton.jit
def attend_slots(q, K, V, slots, cols, mask_n, last, m_i, l_i, acc, scale, kv_head,
                 stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, K_SCALE=None,
                 V_SCALE=None, stride_st=0):
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
        v_scale = tl.load(V_SCALE + slots * stride_st, mask=mask_n, other=1.0)
        k = k.to(q.dtype)
    qk = tl.dot(q, dot_operand(k, UPCAST), input_precision=PRECISION)
    if KV_FP8:
        qk = qk * (k_scale * scale)[None, :]
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
        p_v = p * v_scale[None, :]
    else:
        p_v = p
    v = dot_operand(v, UPCAST)
    acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc
