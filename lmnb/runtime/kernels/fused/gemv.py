"""Skinny GEMM for decode: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias) for a few rows M.

At batch 1..16 a linear layer is a stream over its weight: every weight byte is read once and
used M times, so the kernel's speed is the HBM read bandwidth it reaches. Each program owns
BLOCK_N output features and walks their weight rows in [BLOCK_N, BLOCK_K] tiles (K contiguous:
coalesced 16-byte loads, `evict_first` since the weight is never read again in the step),
multiplying each tile with the few x rows (tiny, read through the caches):

    M == 1, FMA path:  acc[BLOCK_N, BLOCK_K] += w * x   (fp32, summed over K once at the end)
    M <= 16, dot path: acc[16, BLOCK_N] = dot(x padded to 16 rows, w^T)  (tensor cores)

With SPLIT_K > 1, program (n, s) covers the s-th slice of K and writes fp32 partials
[SPLIT_K, M, N]; a second small kernel sums them, adds the bias and rounds: more programs in
flight for shapes with few output blocks (small N). The config comes from `skinny_config`, a
deterministic function of the shape (no autotuning: CUDA-graph capture must not benchmark).
Allocations have fixed shapes, there is no host sync: capturable. FP8 weights have their own
kernel (`gemv_fp8.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_upcast
from lmnb.runtime.kernels.fused.activation import silu_mul
from lmnb.runtime.kernels.interpreter import INTERPRETED
from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous

SKINNY_MAX_ROWS = 16  # rows the dot path pads to (one m16 tensor-core tile)


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool  # tensor-core dot over 16 padded rows; False: FMA path (M <= 4)


@triton.jit(do_not_specialize=["M"])  # one compile serves every batch size of a config
def _skinny_kernel(
    X, W, B, OUT, PARTIAL,
    M, N, K, stride_xm, stride_wn, stride_om, k_span,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_span
    k_end = tl.minimum(k_start + k_span, K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]

    if BLOCK_M == 1 and not USE_DOT:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            mask_k = (k + offs_k) < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT and DOT_UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision=DOT_PRECISION)
        elif USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        elif BLOCK_M == 1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if BLOCK_M == 1 and not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]

    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        part_ptrs = PARTIAL + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    PARTIAL, B, OUT, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    GATED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """out [M, N] = sum of PARTIAL [SPLIT_K, M, N] (+ bias), rounded to OUT's dtype. GATED:
    PARTIAL [SPLIT_K, M, 2N] holds gate | up, out = silu(gate) * up (`activation.silu_mul`)."""
    wait_for_previous(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    row = offs // N
    col = offs % N
    if GATED:
        gate = tl.zeros((BLOCK,), dtype=tl.float32)
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        base = row * 2 * N + col
        for s in tl.static_range(SPLIT_K):
            gate += tl.load(PARTIAL + s * M * 2 * N + base, mask=mask, other=0.0)
            up += tl.load(PARTIAL + s * M * 2 * N + base + N, mask=mask, other=0.0)
        if HAS_BIAS:
            gate += tl.load(B + col, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(B + N + col, mask=mask, other=0.0).to(tl.float32)
        dtype = OUT.dtype.element_ty
        acc = silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(PARTIAL + s * M * N + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(B + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_om + col, acc.to(OUT.dtype.element_ty), mask=mask)


def split_k_span(k: int, split_k: int, block_k: int) -> int:
    """Columns of K each of `split_k` slices sums: whole `block_k` steps (the last slice
    shorter, or empty)."""
    return max(triton.cdiv(triton.cdiv(k, split_k), block_k), 1) * block_k


def split_k_partials(out: torch.Tensor, rows: int, columns: int, split_k: int) -> torch.Tensor:
    """Where a split-K kernel's programs store their sums: `out` itself without a split, else
    float32 partials [split_k, rows, columns] for `reduce_split_k`."""
    if split_k == 1:
        return out
    return torch.empty((split_k, rows, columns), dtype=torch.float32, device=out.device)


def reduce_split_k(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *,
                   gated: bool = False) -> None:
    """out [M, N] = the sum of partial [SPLIT_K, M, N] (+ bias); `gated`: partial holds
    gate | up [SPLIT_K, M, 2N], out = silu(gate) * up (`_split_k_reduce_kernel`)."""
    m, n = out.shape
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partial, bias if bias is not None else out, out, m, n, out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=partial.shape[0], BLOCK=block, GATED=gated,
        num_warps=4, **pdl_args(out.device))


MIN_PROGRAMS = 256  # below this many output blocks, split K


@functools.lru_cache(maxsize=1024)
def skinny_config(m: int, n: int, k: int, dtype: torch.dtype) -> SkinnyConfig:
    """The launch config for out [m, n] = x [m, k] @ w [n, k]^T (`dtype`: the weight's; tiles are
    sized in bytes); deterministic, no benchmarking.

    - M == 1: FMA path (no padded rows, no shared memory), one weight row a program in 2 KB
      chunks (1024 16-bit elements), 4 stages of loads in flight: N programs (4096 and more on
      Llama shapes) keep every SM streaming. Swept on an H100 (bench/gemv.py --sweep): 99-107%
      of the copy bandwidth on every Llama-2-7B / Llama-3-8B shape, 12% less time than cuBLAS
      over a step's linears; 2-16 row tiles and 4-16 KB tiles were 1-3% slower.
    - M >= 2: tensor-core dot over 16 padded rows (M up to 16 costs what M = 2 does), [32 rows,
      512 B] weight tiles through shared memory with 5 stages of cp.async prefetch (120 KB of
      shared memory at most); the best of the sweep at M = 2 and 4 over all shapes.
    - SPLIT_K (a power of two, each slice >= 1024 of K and >= BLOCK_K) while the output
      blocks are fewer than MIN_PROGRAMS; it costs a second, tiny kernel (the fp32 partial
      sum), so it is for small N (tiny models, tensor-parallel shards), not Llama-7B shapes.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    k_pow2 = triton.next_power_of_2(max(k, 16))
    if m == 1:
        block_n, block_k = 1, min(2048 // elem, k_pow2)
        use_dot, num_warps, num_stages = False, 4, 4
    else:
        block_n, block_k = 32, min(512 // elem, k_pow2)
        use_dot, num_warps, num_stages = True, 4, 5
    blocks = triton.cdiv(n, block_n)
    split_k = 1
    while (blocks * split_k < MIN_PROGRAMS
           and k // (2 * split_k) >= max(1024, block_k) and split_k < 16):
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k, num_warps, num_stages, use_dot)


@functools.lru_cache(maxsize=1024)
def interpreter_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Triton's CPU interpreter runs each program in Python (~10 ms each) but a tile in numpy at
    once: few, big programs (the GPU configs are tested with explicit `config`s)."""
    block_k = min(triton.next_power_of_2(max(k, 16)), 256)
    block_n = min(triton.next_power_of_2(max(n, 16)), (1 << 18) // block_k)
    return SkinnyConfig(block_n, block_k, 1, 4, 1, m > 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous, 1 <= M <= SKINNY_MAX_ROWS), weight [N, K] contiguous (the
    nn.Linear layout), bias [N] or None -> [M, N] in x's dtype (fp32 accumulation).
    `config` overrides the heuristic (benchmark sweeps)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [rows, K] with rows contiguous"
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= SKINNY_MAX_ROWS, f"{m} rows: the skinny kernel takes 1..{SKINNY_MAX_ROWS}"
    assert weight.shape == (n, k) and weight.stride() == (k, 1), "weight must be [N, K] contiguous"
    assert bias is None or bias.shape == (n,)
    assert weight.dtype == x.dtype, "FP8 weights: kernels.fused.gemv_fp8"
    cfg = config or (interpreter_config(m, n, k) if INTERPRETED
                     else skinny_config(m, n, k, weight.dtype))
    if not cfg.use_dot:
        assert m <= 4, "the FMA path takes up to 4 rows"
    block_m = 16 if cfg.use_dot else triton.next_power_of_2(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_span = split_k_span(k, cfg.split_k, cfg.block_k)
    partial = split_k_partials(out, m, n, cfg.split_k)
    b = bias if bias is not None else out  # unused without HAS_BIAS
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _skinny_kernel[grid](
        x, weight, b, out, partial,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_span,
        HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, EVEN_K=k % k_span == 0 and
        k_span % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=dot_upcast(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    if cfg.split_k > 1:
        reduce_split_k(partial, bias, out)
    return out
