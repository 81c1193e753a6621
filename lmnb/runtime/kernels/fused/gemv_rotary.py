"""The qkv GEMV's rotary epilogue (`gemv_fp8.fp8_norm_gemv(..., rope=)`): neox rotary of the q and
k heads, q written out, k and v stored in the KV pool at the tokens' slots (`rope.rotary_qkv`'s
math, so the stored rows are the same).

A program owns BLOCK_N / 2 (d, d + head_dim / 2) row pairs of qkv's heads, for all its tokens:

    16/32-bit pool   each pair's rotated k (or v) goes straight to its slot.
    FP8 pool         a (token, KV head) row is stored divided by its scale amax / 448, the scale
                     beside the pool (`KVStorage`), but at batch 1 a head's pairs are spread over
                     many programs (2 rows a program). Each program stages its float32 k / v
                     pairs in STAGE [M, 2 * kv_heads * head_dim], then adds its pairs' count to
                     the head's arrival counter (a barrier, then one gpu-scope acq_rel atomic);
                     the program that completes a head reads the head's staged rows (past L1),
                     quantizes them as `rope.fp8_rows` does, stores bytes and scales and resets
                     the counter to 0. The counters are shared by every launch on a device (one
                     launch at a time, `arrivals.py`) and are zero between launches.
    FP8 pool with    (`kv_storage.fixed_fp8_scales`, KV_FIXED_FP8) no head's amax is needed: each
    fixed scales     pair is divided by its head's scale and goes straight to its slot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.arrivals import arrival_counters
from lmnb.runtime.kernels.fused.fp8_quant import FP8_MAX
from lmnb.runtime.kernels.fused.rope import fixed_fp8_rows, fp8_rows, rotate
from lmnb.runtime.memory.kv_storage import fixed_fp8_scales

FP8 = torch.float8_e4m3fn
_FP8_MAX = tl.constexpr(FP8_MAX)  # a global a kernel reads must be a constexpr


class RotaryStore(NamedTuple):
    """The neox rotary behind a qkv GEMM (`fp8_norm_gemv(..., rope=)`): q comes back, k and v
    go to the KV buffers at `slots`, as `rope.rotary_qkv(..., kv_buffers=, slots=)` does."""

    positions: torch.Tensor  # [M] int
    cos: torch.Tensor  # [max_positions, >= head_dim / 2] float32, rows contiguous
    sin: torch.Tensor  # the same shape and strides
    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_buffer: torch.Tensor  # [slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    slots: torch.Tensor  # [M] int
    # FP8 buffers: (k_scales, v_scales) [slots, num_kv_heads] float32 (`KVStorage.scales`)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None


@triton.jit
def rotary_inputs(pid_n, offs_m, mask_m, N, POS, COS, SIN, SLOTS, stride_cos,
                  BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """cos, sin [BLOCK_N / 2, BLOCK_M] of this program's (d, d + HALF) pairs at the rows'
    positions, and the rows' KV slots [BLOCK_M]: loaded before the K loop, in flight while it
    runs (COS, SIN: [positions, >= HALF] float32)."""
    pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    inside = (pair < N // 2)[:, None] & mask_m[None, :]
    pos = tl.load(POS + offs_m, mask=mask_m, other=0).to(tl.int64)
    trig = pos[None, :] * stride_cos + (pair % HALF)[:, None]
    cos = tl.load(COS + trig, mask=inside, other=0.0)
    sin = tl.load(SIN + trig, mask=inside, other=0.0)
    slot = tl.load(SLOTS + offs_m, mask=mask_m, other=0).to(tl.int64)
    return cos, sin, slot


@triton.jit
def _store_fp8_head(kv, slot, offs_m, mask_m, STAGE, K_OUT, V_OUT, K_SCALE, V_SCALE,
                    stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_st, stride_sh,
                    num_kv_heads, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, FP8_MAX: tl.constexpr):
    """The staged rows of K|V head `kv` (< num_kv_heads: K's) for the tokens [BLOCK_M] ->
    e4m3 at their slots, each token's scale beside them."""
    offs = tl.arange(0, BLOCK_HALF)
    mask = mask_m[:, None] & (offs < HALF)[None, :]
    src = STAGE + offs_m[:, None] * (2 * num_kv_heads * HEAD_DIM) + kv * HEAD_DIM + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")  # L2: other SMs wrote them
    x2 = tl.load(src + HALF, mask=mask, other=0.0, cache_modifier=".cg")
    y1, y2, scale = fp8_rows(x1, x2, FP8_MAX)
    is_k = kv < num_kv_heads  # K's head kv, else V's head kv - num_kv_heads
    h = tl.where(is_k, kv, kv - num_kv_heads)
    out = tl.where(is_k, K_OUT, V_OUT)  # both FP8 (`rotary_launch` checks)
    stride_row = tl.where(is_k, stride_k_row, stride_v_row)
    stride_head = tl.where(is_k, stride_k_head, stride_v_head)
    tl.store(tl.where(is_k, K_SCALE, V_SCALE) + slot * stride_st + h * stride_sh, scale,
             mask=mask_m)
    dst = out + slot[:, None] * stride_row + h * stride_head + offs[None, :]
    tl.store(dst, y1.to(K_OUT.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(K_OUT.dtype.element_ty), mask=mask)


@triton.jit
def _complete_fp8_heads(pid_n, N, slot, offs_m, mask_m, STAGE, ARRIVALS, K_OUT, V_OUT,
                        K_SCALE, V_SCALE, stride_k_row, stride_k_head, stride_v_row,
                        stride_v_head, stride_st, stride_sh, num_heads, num_kv_heads,
                        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, HEADS_A_PROGRAM: tl.constexpr):
    """After this program staged its K/V pairs: count them in for each head they belong to;
    the program that completes a head stores it (see the module docstring)."""
    first = pid_n * (BLOCK_N // 2)
    end = tl.minimum(first + BLOCK_N // 2, N // 2)  # past this program's last pair
    tl.debug_barrier()  # every thread's staged pairs are written before the count says so
    for j in tl.static_range(HEADS_A_PROGRAM):
        head = first // HALF + j
        lo = tl.maximum(first, head * HALF)
        hi = tl.minimum(end, (head + 1) * HALF)
        if (head >= num_heads) & (lo < hi):
            kv = head - num_heads
            before = tl.atomic_add(ARRIVALS + kv, hi - lo, sem="acq_rel", scope="gpu")
            if before + (hi - lo) == HALF:  # the head's last pairs: all staged
                tl.store(ARRIVALS + kv, 0)
                _store_fp8_head(kv, slot, offs_m, mask_m, STAGE, K_OUT, V_OUT, K_SCALE,
                                V_SCALE, stride_k_row, stride_k_head, stride_v_row,
                                stride_v_head, stride_st, stride_sh, num_kv_heads, HEAD_DIM, HALF,
                                BLOCK_HALF, _FP8_MAX)


@triton.jit
def rotary_epilogue(acc, cos, sin, slot, pid_n, offs_m, mask_m, N, Q_OUT, K_OUT, V_OUT,
                    K_SCALE, V_SCALE, STAGE, ARRIVALS, stride_q, stride_k_row, stride_k_head,
                    stride_v_row, stride_v_head, stride_st, stride_sh, num_heads, num_kv_heads,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    HEADS_A_PROGRAM: tl.constexpr, KV_FIXED_FP8: tl.constexpr):
    """qkv's out^T [BLOCK_N, BLOCK_M] in (d, d + HALF) row pairs -> neox rotary of the q and k
    heads (`rope.rotary_qkv`'s math: qkv rounded to its dtype, rotated in float32): q to
    Q_OUT [M, heads * HEAD_DIM], k and v to row `slot` of the KV buffers (KV_FP8: through
    STAGE, with scales; KV_FIXED_FP8: divided by the pool's fixed scales)."""
    dtype = Q_OUT.dtype.element_ty
    pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_N // 2, 2, BLOCK_M)),
                       (0, 2, 1))
    x1, x2 = tl.split(pairs)  # [BLOCK_N / 2, BLOCK_M]: elements d and d + HALF of a head
    pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head = pair // HALF
    d = pair % HALF
    inside = (pair < N // 2)[:, None] & mask_m[None, :]
    is_q = (head < num_heads)[:, None]
    is_kv = (head < num_heads + num_kv_heads)[:, None]
    rotated = is_kv  # q and k heads
    r1, r2 = rotate(x1, x2, cos, sin)
    y1 = tl.where(rotated, r1, x1)
    y2 = tl.where(rotated, r2, x2)
    q_ptrs = Q_OUT + offs_m[None, :] * stride_q + (head * HEAD_DIM + d)[:, None]
    tl.store(q_ptrs, y1.to(dtype), mask=inside & is_q)
    tl.store(q_ptrs + HALF, y2.to(dtype), mask=inside & is_q)
    if KV_FP8:  # k | v heads' pairs staged in float32, stored once a head is complete
        s_ptrs = (STAGE + offs_m[None, :] * (2 * num_kv_heads * HEAD_DIM)
                  + ((head - num_heads) * HEAD_DIM + d)[:, None])
        tl.store(s_ptrs, y1, mask=inside & ~is_q)
        tl.store(s_ptrs + HALF, y2, mask=inside & ~is_q)
        _complete_fp8_heads(pid_n, N, slot, offs_m, mask_m, STAGE, ARRIVALS, K_OUT, V_OUT,
                            K_SCALE, V_SCALE, stride_k_row, stride_k_head, stride_v_row,
                            stride_v_head, stride_st, stride_sh, num_heads, num_kv_heads, BLOCK_N,
                            HEAD_DIM, HALF, BLOCK_HALF, HEADS_A_PROGRAM)
    else:
        is_k = is_kv & ~is_q
        k1, k2, v1, v2 = y1, y2, x1, x2
        if KV_FIXED_FP8:  # each pair's head's scale (slot stride 0)
            kv_head = tl.where(head < num_heads + num_kv_heads, head - num_heads,
                               head - num_heads - num_kv_heads)
            has_scale = (kv_head >= 0) & (kv_head < num_kv_heads)  # a k or v head's pair
            scale_at = tl.where(has_scale, kv_head, 0) * stride_sh
            k_scale = tl.load(K_SCALE + scale_at, mask=has_scale, other=1.0)
            v_scale = tl.load(V_SCALE + scale_at, mask=has_scale, other=1.0)
            k1, k2 = fixed_fp8_rows(y1, y2, k_scale, _FP8_MAX)
            v1, v2 = fixed_fp8_rows(x1, x2, v_scale, _FP8_MAX)
        k_ptrs = (K_OUT + slot[None, :] * stride_k_row
                  + ((head - num_heads) * stride_k_head + d)[:, None])
        tl.store(k_ptrs, k1.to(K_OUT.dtype.element_ty), mask=inside & is_k)
        tl.store(k_ptrs + HALF, k2.to(K_OUT.dtype.element_ty), mask=inside & is_k)
        v_ptrs = (V_OUT + slot[None, :] * stride_v_row
                  + ((head - num_heads - num_kv_heads) * stride_v_head + d)[:, None])
        tl.store(v_ptrs, v1.to(V_OUT.dtype.element_ty), mask=inside & ~is_kv)
        tl.store(v_ptrs + HALF, v2.to(V_OUT.dtype.element_ty), mask=inside & ~is_kv)


class RotaryLaunch(NamedTuple):
    """`RotaryStore` as the GEMV kernel's arguments (`gemv_fp8._fp8_gemv_kernel`)."""

    tensors: tuple[torch.Tensor, ...]  # POS, COS, SIN, SLOTS, K_OUT, V_OUT, K_SCALE, V_SCALE,
    # STAGE, ARRIVALS
    # stride_cos, k / v row and head strides, the scales' slot and head strides, heads, kv heads
    ints: tuple[int, ...]
    constexprs: dict[str, int | bool]


def rotary_launch(rope: RotaryStore | None, *, m: int, n: int, filler: torch.Tensor,
                  block_n: int) -> RotaryLaunch:
    """Checks `rope` against the qkv GEMM [m rows, n weight rows] and packs it; None: `filler`
    in every (unread) pointer."""
    if rope is None:
        return RotaryLaunch((filler,) * 10, (0,) * 9, {})
    half = rope.head_dim // 2
    assert rope.head_dim % 2 == 0 and n == (rope.num_heads + 2 * rope.num_kv_heads) * \
        rope.head_dim, "rope: the weight's rows are q, k and v heads"
    assert rope.cos.stride() == rope.sin.stride() and rope.cos.stride(-1) == 1
    assert rope.cos.shape[-1] >= half and rope.positions.shape == rope.slots.shape == (m,)
    k_buf, v_buf = rope.k_buffer, rope.v_buffer
    assert k_buf.shape[1:] == v_buf.shape[1:] == (rope.num_kv_heads, rope.head_dim)
    assert k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    pool_fp8, kv_fixed_fp8 = FP8 in (k_buf.dtype, v_buf.dtype), False
    if pool_fp8:  # per-(token, head) or fixed scales
        assert k_buf.dtype == v_buf.dtype, "an FP8 pool stores K and V in FP8"
        if rope.kv_scales is None:
            raise ValueError("an FP8 KV pool needs its scales: RotaryStore(..., kv_scales=)")
        k_scale, v_scale = rope.kv_scales
        assert k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.shape == v_scale.shape == k_buf.shape[:2] and k_scale.stride() == \
            v_scale.stride()  # any layout (`KVStorage`'s is head-major)
        stride_st, stride_sh = k_scale.stride()
        kv_fixed_fp8 = fixed_fp8_scales(k_scale)
    else:
        k_scale = v_scale = filler  # unread
        stride_st = stride_sh = 0
    kv_fp8 = pool_fp8 and not kv_fixed_fp8  # per-token scales: the heads' rows staged
    if kv_fp8:
        stage = torch.empty((m, 2 * rope.num_kv_heads * rope.head_dim), dtype=torch.float32,
                            device=filler.device)
        arrivals = arrival_counters(filler.device, 2 * rope.num_kv_heads)
    else:
        stage = arrivals = filler  # unread
    pairs = block_n // 2
    return RotaryLaunch(
        (rope.positions, rope.cos, rope.sin, rope.slots, k_buf, v_buf, k_scale, v_scale, stage,
         arrivals),
        (rope.cos.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
         stride_st, stride_sh, rope.num_heads, rope.num_kv_heads),
        {"ROPE": True, "HEAD_DIM": rope.head_dim, "HALF": half, "KV_FP8": kv_fp8,
         "KV_FIXED_FP8": kv_fixed_fp8,
         "BLOCK_HALF": triton.next_power_of_2(half),
         "HEADS_A_PROGRAM": (pairs + half - 2) // half + 1})
