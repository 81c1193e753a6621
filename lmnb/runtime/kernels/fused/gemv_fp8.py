"""Skinny GEMM over FP8 weights: out [M, N] = x [M, K] @ (weight [N, K] * scale[:, None])^T
(+ bias) for M <= 16 rows (decode), x in 16/32 bits (W8A16), the weight float8_e4m3fn with one
float32 scale per output row.

A batch-1 linear streams its weight once, so the kernel's speed is the HBM read bandwidth it
reaches; FP8 halves the bytes but keeps the element count, which changes what limits a kernel
tuned for 16-bit weights (`gemv.py`):

- Register layouts. A 16-byte vector is 16 FP8 weights but only 8 bf16 activations, so Triton
  gives the two loads different layouts and moves the weight through shared memory (two
  barriers) every iteration. Here both are read FMA_VEC (8) elements a thread: 8-byte weight loads,
  16-byte activation loads, one layout, no shuffle; BLOCK_N rows a program reuse each
  activation load (L1/L2 traffic for x: 2 / BLOCK_N bytes per weight byte).
- Instructions. At 1 byte a weight the FMA path issues twice the instructions per byte that
  the 16-bit kernel does, and Triton's FP8 cast adds more: e4m3 -> bf16 goes through f16 (two
  conversions an element), and each byte is extracted and repacked before `cvt.f16x2.e4m3x2`.
  Here, for 16-bit x and K % 4 == 0 ("packed"), the weight is read as int32 and x as int64 (4
  values each, same layout), inline PTX converts the int32's halves straight to f16 pairs, then
  f16 -> f32 (an FMA-pipe add), and a chain of 4 FMAs accumulates: 84 instead of 128 sm_90
  instructions a step of 2 rows x 8 weights. The dot path needs x's dtype: e4m3 -> f16 -> f32
  -> bf16.
- Split K fills the SMs where N / BLOCK_N programs are few (N = 4096 at 2-4 rows a program):
  program (n, s) writes fp32 partials [SPLIT_K, M, N], `gemv._split_k_reduce_kernel` sums them.
- The scale multiplies each output once, after the K loop (it factors out of the K sum).

Paths (`Fp8GemvConfig.use_dot`):
    FMA  (M == 1): acc[BLOCK_N, BLOCK_K / 8] += sum of 8 products w * x a thread, in f32
         registers, summed across threads once after the K loop.
    dot  (M <= 16): out^T tile [BLOCK_N, 16] = dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, 16]): the
         weight is the dot's left operand (converted in registers), x padded to 16 rows.

Decode's fusions (one launch where a layer had five small kernels besides its GEMMs; at batch 1
a launch costs about what streaming 6 MB of FP8 weights does):
    GATED  gate_up's [gate | up] rows in (gate, up) pairs a program; the epilogue writes
           silu(gate) * up (`activation.silu_mul`; the split-K reduce does the same).
    NORM   `fp8_norm_gemv`: RMSNorm (+ the residual add) in the prologue. Each program walks all
           of K anyway: it sums s^2 of s = x + residual as it goes and multiplies the weight by
           s * g (compiled bf16: two bf16x2 instructions a pair), its sums by rstd after the
           loop; the first programs write the residual stream, 1024 columns each. No split K.
    ROPE   qkv's rows in (d, d + head_dim / 2) pairs of a head; the epilogue applies the neox
           rotary, writes q and stores k and v in the KV pool at the tokens' slots (`rope.py`'s
           math), an FP8 pool's with per-(token, head) scales (`gemv_rotary.py`).

The launch config is a deterministic function of (M, N, K) (`fp8_gemv_config`: the `TUNED` table
that `python bench/gemv.py --fp8 --sweep` prints, else a rule); no autotuning, no host sync,
fixed allocations: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_upcast
from lmnb.runtime.kernels.e4m3_words import e4m3x4
from lmnb.runtime.kernels.fused.activation import silu_mul
from lmnb.runtime.kernels.fused.gemv import (
    SKINNY_MAX_ROWS,
    reduce_split_k,
    split_k_partials,
    split_k_span,
)
from lmnb.runtime.kernels.fused.gemv_rotary import (
    RotaryStore,
    rotary_epilogue,
    rotary_inputs,
    rotary_launch,
)
from lmnb.runtime.kernels.interpreter import INTERPRETED
from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous

STREAM_BLOCK: tl.constexpr = tl.constexpr(1024)  # the residual stream's store: columns a step
FMA_VEC = 8  # FMA path: elements a thread loads at once (8 B of weight, 16 B of activations)
DOT_VEC = 16  # dot path (both through shared memory): 16-byte asynchronous copies of the weight


class Fp8GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int  # dot: Triton's cp.async stages; FMA: 2 = prefetch the next step, 1 = not
    use_dot: bool  # tensor-core dot over 16 padded rows; False: FMA path (M == 1 only)


@triton.jit
def _load_step(w_ptrs, x_ptrs, k, k_end, offs_k, mask_n, mask_m, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] and x tile [BLOCK_M, BLOCK_K] at column k; nothing
    is read at or past k_end (a prefetch past the last step reads nothing)."""
    return (_load_w(w_ptrs, k, k_end, offs_k, mask_n, EVEN_K),
            _load_x(x_ptrs, k, k_end, offs_k, mask_m, EVEN_K))


@triton.jit
def _load_w(w_ptrs, k, k_end, offs_k, mask_n, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at column k, as `_load_step` reads it."""
    if EVEN_K:
        inside = (tl.zeros((1, 1), dtype=tl.int32) + k) < k_end  # [1, 1]: the interpreter's too
        return tl.load(w_ptrs, mask=mask_n[:, None] & inside, other=0.0,
                       eviction_policy="evict_first")
    else:
        return tl.load(w_ptrs, mask=mask_n[:, None] & ((k + offs_k) < k_end)[None, :],
                       other=0.0, eviction_policy="evict_first")


@triton.jit
def _half(bits):
    """The low 16 bits of an int32 as an f16 -> f32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x16x4_to_f32(x, X_BF16: tl.constexpr):
    """int64 of four 16-bit activations (little-endian) -> four f32 tensors of x's shape: bf16
    by shifts and masks, f16 through a cast."""
    lo = x.to(tl.int32)
    hi = (x >> 32).to(tl.int32)
    if X_BF16:
        return ((lo << 16).to(tl.float32, bitcast=True),
                (lo & -65536).to(tl.float32, bitcast=True),
                (hi << 16).to(tl.float32, bitcast=True),
                (hi & -65536).to(tl.float32, bitcast=True))
    else:
        return _half(lo), _half(lo >> 16), _half(hi), _half(hi >> 16)


@triton.jit
def _fma_step(acc, w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC_K: tl.constexpr,
              PACKED: tl.constexpr, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """One step of the FMA path (one x row), f32 accumulation.
    PACKED: w [BLOCK_N, BLOCK_K] int32 (4 weights each), x [1, BLOCK_K] int64 (4 16-bit
    activations each), acc [BLOCK_N, BLOCK_K] += the 4 products (a chain of FMAs).
    Else: FP8 and 16/32-bit elements, e4m3 -> f16 -> f32 (exact), acc [BLOCK_N, BLOCK_K / VEC_K]
    += each thread's VEC_K products, summed in registers."""
    if PACKED:
        w0, w1, w2, w3 = e4m3x4(w, tl.float32, ASM)
        x0, x1, x2, x3 = _x16x4_to_f32(x, X_BF16)
        return acc + w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
    else:
        prod = w.to(tl.float16).to(tl.float32) * x.to(tl.float32)
        return acc + tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // VEC_K, VEC_K)), axis=2)


@triton.jit
def _load_x(x_ptrs, k, k_end, offs_k, mask_m, EVEN_K: tl.constexpr):
    """x's tile [BLOCK_M, BLOCK_K] at column k, as `_load_step` reads it (the residual too)."""
    if EVEN_K:
        inside = (tl.zeros((1, 1), dtype=tl.int32) + k) < k_end
        return tl.load(x_ptrs, mask=mask_m[:, None] & inside, other=0.0)
    else:
        return tl.load(x_ptrs, mask=mask_m[:, None] & ((k + offs_k) < k_end)[None, :], other=0.0)


@triton.jit
def _load_k(ptrs, k, k_end, offs_k, EVEN_K: tl.constexpr):
    """A [1, BLOCK_K] vector (the norm's weight) at column k; nothing at or past k_end."""
    if EVEN_K:
        inside = (tl.zeros((1, 1), dtype=tl.int32) + k) < k_end
        return tl.load(ptrs, mask=inside, other=0.0)
    else:
        return tl.load(ptrs, mask=((k + offs_k) < k_end)[None, :], other=0.0)


@triton.jit
def _normed_x(x, r, g, HAS_RES: tl.constexpr, DTYPE: tl.constexpr):
    """One element group of the RMSNorm prologue, float32: s = x + r rounded to DTYPE (the
    residual stream) -> (s, s * g); the caller sums s^2 for rstd."""
    s = x
    if HAS_RES:
        s = (x + r).to(DTYPE).to(tl.float32)
    return s, s * g


@triton.jit
def _bf16x2_normed(x, r, g, HAS_RES: tl.constexpr):
    """int32s of 2 bf16 each (x, r, g) -> f32 (h0, h1, s0, s1): s = x + r and h = s * g in
    bf16x2 arithmetic (sm_90: one instruction a pair; s rounds as torch's bf16 add does), then
    widened by shifts. Without HAS_RES, s = x and r is not read."""
    if HAS_RES:
        h0, h1, s0, s1 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 s, h;
            add.rn.bf16x2 s, $4, $5;
            mul.rn.bf16x2 h, s, $6;
            shl.b32 $0, h, 16;
            and.b32 $1, h, 0xFFFF0000;
            shl.b32 $2, s, 16;
            and.b32 $3, s, 0xFFFF0000;
            }""",
            constraints="=r,=r,=r,=r,r,r,r", args=[x, r, g],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        h0, h1, s0, s1 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 h;
            mul.rn.bf16x2 h, $4, $5;
            shl.b32 $0, h, 16;
            and.b32 $1, h, 0xFFFF0000;
            shl.b32 $2, $4, 16;
            and.b32 $3, $4, 0xFFFF0000;
            }""",
            constraints="=r,=r,=r,=r,r,r", args=[x, g],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return (h0.to(tl.float32, bitcast=True), h1.to(tl.float32, bitcast=True),
            s0.to(tl.float32, bitcast=True), s1.to(tl.float32, bitcast=True))


@triton.jit
def _norm_fma_step(acc, ss, w, x, r, g, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, VEC_K: tl.constexpr, PACKED: tl.constexpr,
                   X_BF16: tl.constexpr, ASM: tl.constexpr, HAS_RES: tl.constexpr,
                   DTYPE: tl.constexpr):
    """`_fma_step` over rmsnorm's input: x (+ r) -> s, ss += s^2, acc += w * (s * g): the
    norm's rstd multiplies the sums once, after the K loop. r, g: x's layout (PACKED: int64s
    of 4)."""
    if PACKED and X_BF16 and ASM:  # the norm's elementwise part in bf16x2 (compiled)
        h0, h1, s0, s1 = _bf16x2_normed(x.to(tl.int32), r.to(tl.int32), g.to(tl.int32),
                                        HAS_RES)
        h2, h3, s2, s3 = _bf16x2_normed((x >> 32).to(tl.int32), (r >> 32).to(tl.int32),
                                        (g >> 32).to(tl.int32), HAS_RES)
        w0, w1, w2, w3 = e4m3x4(w, tl.float32, ASM)
        ss += s0 * s0 + s1 * s1 + s2 * s2 + s3 * s3
        return acc + w0 * h0 + w1 * h1 + w2 * h2 + w3 * h3, ss
    elif PACKED:
        x0, x1, x2, x3 = _x16x4_to_f32(x, X_BF16)
        r0, r1, r2, r3 = _x16x4_to_f32(r, X_BF16)
        g0, g1, g2, g3 = _x16x4_to_f32(g, X_BF16)
        s0, h0 = _normed_x(x0, r0, g0, HAS_RES, DTYPE)
        s1, h1 = _normed_x(x1, r1, g1, HAS_RES, DTYPE)
        s2, h2 = _normed_x(x2, r2, g2, HAS_RES, DTYPE)
        s3, h3 = _normed_x(x3, r3, g3, HAS_RES, DTYPE)
        w0, w1, w2, w3 = e4m3x4(w, tl.float32, ASM)
        ss += s0 * s0 + s1 * s1 + s2 * s2 + s3 * s3
        return acc + w0 * h0 + w1 * h1 + w2 * h2 + w3 * h3, ss
    else:
        sx, h = _normed_x(x.to(tl.float32), r.to(tl.float32), g.to(tl.float32), HAS_RES,
                          DTYPE)
        prod = w.to(tl.float16).to(tl.float32) * h
        acc = acc + tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // VEC_K, VEC_K)), axis=2)
        return acc, ss + sx * sx


@triton.jit(do_not_specialize=["M"])  # one compile serves every batch size of a config
def _fp8_gemv_kernel(
    X, W, W_SCALE, B, OUT, PARTIAL, RES, NORM_W, X16, RES16, RES_OUT,
    POS, COS, SIN, SLOTS, K_OUT, V_OUT, K_SCALE, V_SCALE, STAGE, ARRIVALS,
    M, N, K, stride_xm, stride_wn, stride_om, k_span, hidden, stride_x16, eps,
    stride_cos, stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_st, stride_sh,
    num_heads, num_kv_heads,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
    PACKED: tl.constexpr, X_BF16: tl.constexpr, ASM_CVT: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr,
    ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 2, HALF: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False, BLOCK_HALF: tl.constexpr = 1, HEADS_A_PROGRAM: tl.constexpr = 1,
    KV_FIXED_FP8: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if GATED:  # N outputs, 2N weight rows (gate | up): rows 2i, 2i + 1 = gate, up of output i
        half = tl.arange(0, BLOCK_N) // 2
        cols = pid_n * (BLOCK_N // 2) + half
        offs_n = cols + (tl.arange(0, BLOCK_N) % 2) * N  # weight rows
        mask_n = cols < N
        rows_w = 2 * N
    elif ROPE:  # qkv's rows in (d, d + HALF) pairs of a head: rows 2i, 2i + 1 of pair i
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        offs_n = (pair // HALF) * HEAD_DIM + pair % HALF + (tl.arange(0, BLOCK_N) % 2) * HALF
        mask_n = pair < N // 2
        rows_w = N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows_w = N
    # VEC_K contiguous elements a thread: the weight's and x's loads then share one layout
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), VEC_K), VEC_K)
    mask_m = offs_m < M
    k_start = pid_k * k_span
    k_end = tl.minimum(k_start + k_span, K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    if not USE_DOT:  # no kernel writes a weight: its first tile is read before the wait (PDL),
        w_first = _load_w(w_ptrs, k_start, k_end, offs_k, mask_n, EVEN_K)  # beside the tail
        w_ptrs += BLOCK_K  # of the kernel before
    wait_for_previous(USE_PDL)
    if ROPE:
        cos, sin, slot = rotary_inputs(pid_n, offs_m, mask_m, N, POS, COS, SIN, SLOTS,
                                       stride_cos, BLOCK_N, HALF)
    if NORM:  # RMSNorm prologue (SPLIT_K == 1): residual and norm weight in x's layout
        r_ptrs = RES + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        g_ptrs = NORM_W + (k_start + offs_k)[None, :]

    if USE_DOT:  # software-pipelined by Triton (cp.async stages)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if NORM:
            ss_rows = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            w, x = _load_step(w_ptrs, x_ptrs, k, k_end, offs_k, mask_n, mask_m, EVEN_K)
            if NORM:  # x (+ r) -> s (the residual stream), the dot's operand s * g
                r = _load_x(r_ptrs, k, k_end, offs_k, mask_m, EVEN_K)
                sx, h = _normed_x(x.to(tl.float32), r.to(tl.float32),
                                  _load_k(g_ptrs, k, k_end, offs_k, EVEN_K).to(tl.float32),
                                  HAS_RES, RES_OUT.dtype.element_ty)
                ss_rows += tl.sum(sx * sx, axis=1)
                x = h if DOT_UPCAST else h.to(X.dtype.element_ty)
                r_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
            if DOT_UPCAST:  # the interpreter, or fp32 activations
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc,
                             input_precision="ieee")
            else:  # e4m3 -> f16 -> f32 -> x's dtype: exact, fewer conversion instructions
                wx = w.to(tl.float16).to(tl.float32).to(X.dtype.element_ty)
                acc = tl.dot(wx, tl.trans(x), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:  # a few partial sums a thread and row
        acc2 = tl.zeros((BLOCK_N, BLOCK_K if PACKED else BLOCK_K // VEC_K), dtype=tl.float32)
        ss = tl.zeros((1, BLOCK_K), dtype=tl.float32)  # NORM: s^2 a lane
        # the first step's weight tile was read before the wait (`w_first`); its step runs on
        # its own, then the loop from the second step as it would from the first
        if NORM and PREFETCH:  # the next step's w, x, r and g are issued before this step's
            w_next = w_first  # FMAs (qkv: few K steps a program, each a round trip to HBM)
            x_next = _load_x(x_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            r_next = _load_x(r_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            g_next = _load_k(g_ptrs, k_start, k_end, offs_k, EVEN_K)
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            for k in range(k_start, k_end, BLOCK_K):
                w, x, r, g = w_next, x_next, r_next, g_next
                w_next, x_next = _load_step(w_ptrs, x_ptrs, k + BLOCK_K, k_end, offs_k, mask_n,
                                            mask_m, EVEN_K)
                r_next = _load_x(r_ptrs, k + BLOCK_K, k_end, offs_k, mask_m, EVEN_K)
                g_next = _load_k(g_ptrs, k + BLOCK_K, k_end, offs_k, EVEN_K)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
                r_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                acc2, ss = _norm_fma_step(acc2, ss, w, x, r, g, BLOCK_N, BLOCK_K, VEC_K, PACKED,
                                          X_BF16, ASM_CVT, HAS_RES, RES_OUT.dtype.element_ty)
        elif NORM:  # r and g are read as the step runs (L1 hits), not prefetched
            x = _load_x(x_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            r = _load_x(r_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            g = _load_k(g_ptrs, k_start, k_end, offs_k, EVEN_K)
            acc2, ss = _norm_fma_step(acc2, ss, w_first, x, r, g, BLOCK_N, BLOCK_K, VEC_K,
                                      PACKED, X_BF16, ASM_CVT, HAS_RES, RES_OUT.dtype.element_ty)
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
                w, x = _load_step(w_ptrs, x_ptrs, k, k_end, offs_k, mask_n, mask_m, EVEN_K)
                r = _load_x(r_ptrs, k, k_end, offs_k, mask_m, EVEN_K)
                g = _load_k(g_ptrs, k, k_end, offs_k, EVEN_K)
                acc2, ss = _norm_fma_step(acc2, ss, w, x, r, g, BLOCK_N, BLOCK_K, VEC_K, PACKED,
                                          X_BF16, ASM_CVT, HAS_RES, RES_OUT.dtype.element_ty)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
                r_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
        elif PREFETCH:  # the next step's loads are issued before this step's FMAs
            w_next = w_first
            x_next = _load_x(x_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            x_ptrs += BLOCK_K
            for k in range(k_start, k_end, BLOCK_K):
                w, x = w_next, x_next
                w_next, x_next = _load_step(w_ptrs, x_ptrs, k + BLOCK_K, k_end, offs_k, mask_n,
                                            mask_m, EVEN_K)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
                acc2 = _fma_step(acc2, w, x, BLOCK_N, BLOCK_K, VEC_K, PACKED, X_BF16, ASM_CVT)
        else:
            x = _load_x(x_ptrs, k_start, k_end, offs_k, mask_m, EVEN_K)
            acc2 = _fma_step(acc2, w_first, x, BLOCK_N, BLOCK_K, VEC_K, PACKED, X_BF16, ASM_CVT)
            x_ptrs += BLOCK_K
            for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
                w, x = _load_step(w_ptrs, x_ptrs, k, k_end, offs_k, mask_n, mask_m, EVEN_K)
                acc2 = _fma_step(acc2, w, x, BLOCK_N, BLOCK_K, VEC_K, PACKED, X_BF16, ASM_CVT)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
    if NORM and HAS_RES:  # the residual stream s = x + r, STREAM_BLOCK columns a program
        dtype = RES_OUT.dtype.element_ty
        for k0 in range(pid_n * STREAM_BLOCK, hidden, tl.num_programs(0) * STREAM_BLOCK):
            offs = k0 + tl.arange(0, STREAM_BLOCK)
            where = offs_m[:, None] * stride_x16 + offs[None, :]
            inside = mask_m[:, None] & (offs < hidden)[None, :]
            sx = (tl.load(X16 + where, mask=inside, other=0.0).to(tl.float32)
                  + tl.load(RES16 + where, mask=inside, other=0.0).to(tl.float32))
            tl.store(RES_OUT + where, sx.to(dtype), mask=inside)
    scale = tl.load(W_SCALE + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if USE_DOT:
        acc = acc * scale[:, None]  # [BLOCK_N, BLOCK_M]: out^T
        if NORM:
            acc = acc * tl.rsqrt(ss_rows / hidden + eps)[None, :]
    else:
        acc = (tl.sum(acc2, axis=1) * scale)[:, None]  # [BLOCK_N, 1]
        if NORM:
            acc = acc * tl.rsqrt(tl.sum(ss) / hidden + eps)

    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if GATED:  # [BLOCK_N, BLOCK_M] -> gate, up [BLOCK_N / 2, BLOCK_M] -> silu(gate) * up
            dtype = OUT.dtype.element_ty
            pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32),
                                          (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1))
            gate, up = tl.split(pairs)
            out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            out_ptrs = OUT + offs_m[None, :] * stride_om + out_cols[:, None]
            tl.store(out_ptrs, silu_mul(gate, up, dtype).to(dtype),
                     mask=(out_cols < N)[:, None] & mask_m[None, :])
        elif ROPE:
            rotary_epilogue(acc, cos, sin, slot, pid_n, offs_m, mask_m, N, OUT, K_OUT, V_OUT,
                            K_SCALE, V_SCALE, STAGE, ARRIVALS, stride_om, stride_k_row,
                            stride_k_head, stride_v_row, stride_v_head, stride_st, stride_sh,
                            num_heads, num_kv_heads, BLOCK_N, BLOCK_M, HEAD_DIM, HALF, KV_FP8,
                            BLOCK_HALF, HEADS_A_PROGRAM, KV_FIXED_FP8)
        else:
            out_ptrs = OUT + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:  # fp32 partials [SPLIT_K, M, rows of the weight]
        part_ptrs = PARTIAL + (pid_k * M + offs_m[None, :]) * rows_w + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=mask)


MIN_PROGRAMS = 264  # two programs an SM of an H100 (132 SMs) at least, else split K

# (M, N, K) -> config: the best of `python bench/gemv.py --fp8 --sweep` on an H100 80GB (triton
# 3.6, 2026-11-24; rows marked H200: that device's sweep of 2026-12-03, where the H100's pick
# lost; % of the device-to-device copy bandwidth measured in the same run) for
# Llama-3-8B's FP8 linears (M = 1: qkv and gate_up as the fused kernels decode runs, the second
# sweep after the fusions); M = 16 for every M of the dot path. Shapes not listed take the
# rule in `fp8_gemv_config` (`bench/fp8.py --fp8-gemv-table` loads a sweep's JSON for one run).
TUNED: dict[tuple[int, int, int], Fp8GemvConfig] = {
    (1, 6144, 4096): Fp8GemvConfig(4, 512, 1, 2, 2, False),  # qkv + norm + rotary: 66% (H200)
    (1, 4096, 4096): Fp8GemvConfig(2, 1024, 1, 4, 1, False),  # o: 72% of copy
    (1, 28672, 4096): Fp8GemvConfig(8, 256, 1, 1, 1, False),  # gate_up + norm + SiLU: 96%
    (1, 4096, 14336): Fp8GemvConfig(8, 2048, 1, 8, 1, False),  # down: 90% of copy (H200)
    (1, 128256, 4096): Fp8GemvConfig(4, 2048, 1, 8, 1, False),  # lm_head: 105% of copy
    (16, 6144, 4096): Fp8GemvConfig(32, 256, 2, 4, 4, True),  # qkv: 62% of copy
    (16, 4096, 4096): Fp8GemvConfig(32, 256, 1, 4, 4, True),  # o: 56% of copy
    (16, 28672, 4096): Fp8GemvConfig(32, 256, 1, 4, 4, True),  # gate_up: 85% of copy
    (16, 4096, 14336): Fp8GemvConfig(32, 256, 2, 4, 4, True),  # down: 76% of copy
    (16, 128256, 4096): Fp8GemvConfig(32, 256, 1, 4, 4, True),  # lm_head: 96% of copy
}


def _tuned_key(m: int, n: int, k: int) -> tuple[int, int, int]:
    return (1 if m == 1 else SKINNY_MAX_ROWS, n, k)


@functools.lru_cache(maxsize=1024)
def fp8_gemv_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """The launch config for m rows against an FP8 weight [n, k]; deterministic, no benchmarking.

    The table `TUNED` first; otherwise:
    - M == 1: FMA path, 2 weight rows a program (x loaded once for both; N = 4096 makes 2048
      programs, 15.5 an SM, all resident at once), 1024 columns a step (8 a thread over 4
      warps), the next step's loads issued before this step's FMAs (40 registers: 12 programs
      an SM; 2 KB of weight in flight a program).
    - M >= 2: the dot path, 64-row weight tiles (a warpgroup MMA's rows) of 256 columns, 3
      stages of asynchronous copies.
    - SPLIT_K (a power of two, each slice >= 512 columns and >= BLOCK_K) while there are fewer
      than MIN_PROGRAMS programs.
    """
    hit = TUNED.get(_tuned_key(m, n, k))
    if hit is not None:
        return hit
    k_pow2 = triton.next_power_of_2(max(k, 16))
    if m == 1:
        block_n, block_k = 2, min(1024, max(k_pow2, FMA_VEC * 32))
        use_dot, num_warps, num_stages = False, 4, 2
    else:
        block_n, block_k = 64, min(256, max(k_pow2, 32))
        use_dot, num_warps, num_stages = True, 4, 3
    blocks = triton.cdiv(n, block_n)
    split_k = 1
    while (blocks * split_k < MIN_PROGRAMS
           and k // (2 * split_k) >= max(512, block_k) and split_k < 16):
        split_k *= 2
    return Fp8GemvConfig(block_n, block_k, split_k, num_warps, num_stages, use_dot)


@functools.lru_cache(maxsize=1024)
def interpreter_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """Triton's CPU interpreter runs each program in Python but a tile in numpy at once: few,
    big programs (the GPU configs are tested with explicit `config`s)."""
    block_k = min(triton.next_power_of_2(max(k, 16)), 256)
    block_n = min(triton.next_power_of_2(max(n, 16)), (1 << 18) // block_k)
    return Fp8GemvConfig(block_n, block_k, 1, 4, 1, m > 1)


class RmsNormInput(NamedTuple):
    """The RMSNorm in front of a GEMM (`fp8_norm_gemv`): the GEMM reads
    weight * rmsnorm(x + residual) (residual None: of x)."""

    residual: torch.Tensor | None  # [M, K] like x
    weight: torch.Tensor  # [K], x's dtype
    eps: float


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None,
             config: Fp8GemvConfig | None = None, *, gated: bool = False) -> torch.Tensor:
    """x [M, K] (rows contiguous, 1 <= M <= SKINNY_MAX_ROWS; fp32/fp16/bf16), weight [N, K]
    float8_e4m3fn contiguous, weight_scale [N] float32 (row n stands for weight[n] * scale[n]),
    bias [N] or None -> [M, N] in x's dtype (fp32 accumulation). `config` overrides the table
    (benchmark sweeps).

    `gated`: the weight is gate_up's [gate (N/2 rows) | up (N/2 rows)] -> silu(gate) * up
    [M, N/2], the activation in the epilogue (`silu_and_mul(fp8_gemv(...))` in one launch,
    rounded at the same places); a program's BLOCK_N rows are BLOCK_N / 2 (gate, up) pairs."""
    return _launch(x, weight, weight_scale, bias, config, gated=gated, norm=None, rope=None)[0]


def fp8_norm_gemv(x: torch.Tensor, norm: RmsNormInput, weight: torch.Tensor,
                  weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                  config: Fp8GemvConfig | None = None, *, gated: bool = False,
                  rope: RotaryStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_gemv(rms_norm(x, norm.weight, norm.eps, norm.residual), ...)` in one launch ->
    (out, the residual stream x + residual: a new tensor, or x itself without a residual).

    Each program walks all of K (no split K) and so reads the whole row: it sums s^2 of
    s = x + residual as it goes, multiplies the weight by s * norm.weight and its sums by
    rsqrt(mean(s^2) + eps) at the end; the first programs write s. The normed input is never
    rounded to x's dtype (the separate norm rounds it twice): equal in float32 up to the order
    of a sum, within bf16's rounding otherwise.

    `rope` (qkv, not gated): the epilogue also applies the rotary and stores k and v in the KV
    buffers (an FP8 pool's with per-(token, head) scales in `rope.kv_scales`, as
    `rope.rotary_qkv` stores them); `out` is then q [M, num_heads * head_dim]. A program's rows
    are (d, d + head_dim / 2) pairs of a head."""
    assert norm.weight.shape == (x.shape[-1],) and norm.weight.dtype == x.dtype, \
        "the norm's weight: [K] in x's dtype"
    assert norm.residual is None or (norm.residual.shape == x.shape
                                     and norm.residual.dtype == x.dtype)
    assert rope is None or not gated
    return _launch(x, weight, weight_scale, bias, config, gated=gated, norm=norm, rope=rope)


def _launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None, config: Fp8GemvConfig | None, *, gated: bool,
            norm: RmsNormInput | None, rope: RotaryStore | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [rows, K] with rows contiguous"
    m, k = x.shape
    n = weight.shape[0]
    assert not gated or n % 2 == 0, f"gated: {n} weight rows, gate | up expected"
    assert 1 <= m <= SKINNY_MAX_ROWS, f"{m} rows: the skinny kernel takes 1..{SKINNY_MAX_ROWS}"
    assert weight.dtype == torch.float8_e4m3fn, f"weight dtype {weight.dtype}: e4m3 expected"
    assert weight.shape == (n, k) and weight.stride() == (k, 1), "weight must be [N, K] contiguous"
    assert weight_scale.shape == (n,) and weight_scale.dtype == torch.float32
    assert bias is None or bias.shape == (n,)
    cfg = config or (interpreter_config(m, n, k) if INTERPRETED else fp8_gemv_config(m, n, k))
    assert cfg.use_dot or m == 1, "the FMA path takes one row"
    if (gated or rope is not None) and cfg.block_n % 2:  # whole (gate, up) / rotary pairs
        cfg = cfg._replace(block_n=cfg.block_n + 1)
    if (norm is not None or rope is not None) and cfg.split_k > 1:  # all of K a program
        cfg = cfg._replace(split_k=1)
    n_out = n // 2 if gated else n
    if rope is not None:
        n_out = rope.num_heads * rope.head_dim  # q
    vec = DOT_VEC if cfg.use_dot else FMA_VEC
    assert cfg.block_k % vec == 0, f"block_k {cfg.block_k}: a multiple of {vec}"
    block_m = 16 if cfg.use_dot else 1
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    k_span = split_k_span(k, cfg.split_k, cfg.block_k)
    partial = split_k_partials(out, m, n, cfg.split_k)
    b = bias if bias is not None else out  # unused without HAS_BIAS
    res = norm.residual if norm is not None and norm.residual is not None else None
    if res is not None:
        res = res.contiguous()
        x = x.contiguous()
    res_out = x if res is None else torch.empty_like(x)
    # FMA path over 16-bit x: weights read as int32 (4 a value), x as int64 (4 a value), all
    # sizes along K in those units (the norm's residual and weight too)
    packed = (not cfg.use_dot and x.dtype in (torch.float16, torch.bfloat16) and k % 4 == 0
              and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0 and weight.data_ptr() % 4 == 0
              and all(t.data_ptr() % 8 == 0 for t in (
                  () if norm is None else (norm.weight, *(() if res is None else (res,))))))
    q = 4 if packed else 1

    def packed_view(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64) if packed else t

    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    rotary = rotary_launch(rope, m=m, n=n, filler=out, block_n=cfg.block_n)
    _fp8_gemv_kernel[grid](
        packed_view(x), weight.view(torch.int32) if packed else weight,
        weight_scale, b, out, partial,
        packed_view(res if res is not None else x),
        packed_view(norm.weight) if norm is not None else x,
        x, res if res is not None else x, res_out, *rotary.tensors,
        m, n if rope is not None else n_out, k // q, x.stride(0) // q, weight.stride(0) // q,
        out.stride(0), k_span // q, k, x.stride(0), norm.eps if norm is not None else 0.0,
        *rotary.ints,
        HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        EVEN_K=k % k_span == 0 and k_span % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k // q, VEC_K=vec // q,
        USE_DOT=cfg.use_dot, DOT_UPCAST=dot_upcast(x.dtype) or x.dtype == torch.float32,
        PREFETCH=not cfg.use_dot and cfg.num_stages > 1,
        PACKED=packed, X_BF16=x.dtype == torch.bfloat16, ASM_CVT=not INTERPRETED, GATED=gated,
        NORM=norm is not None, HAS_RES=res is not None, **rotary.constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages if cfg.use_dot else 1,
        **pdl_args(x.device),
    )
    if cfg.split_k > 1:
        reduce_split_k(partial, bias, out, gated=gated)
    return out, res_out
