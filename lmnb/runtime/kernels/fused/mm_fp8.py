"""FP8-weight GEMMs for more rows than batch-1 decode's skinny GEMV.

Weight-only (W8A16), `w8a16_mm`:

    out [M, N] = x [M, K] @ (weight [N, K] * scale[:, None])^T (+ bias)   in x's dtype

The FP8 weight tiles are converted to x's dtype in registers (e4m3 values are exact in bf16, fp16
and fp32) and multiplied on the tensor cores with float32 accumulation; the per-row scales apply
to the sums. Each BLOCK_M rows of x read the weight once and no 16-bit copy of it is ever written
(`F.linear(x, dequantize_rows(...))` writes and reads one per call: at Llama-3-8B size ~40 GB of
traffic a forward, more than a decode step's GEMMs).

W8A8, `w8a8_mm`: what `torch._scaled_mm` computes with row-wise scales (per-token FP8 rows times
FP8 weights on the FP8 tensor cores, float32 sums, both scales on the sums), with 64 x 64 tiles for
17-128 rows (rows past M masked), where it takes 0.69-0.86x `_scaled_mm`'s time at Llama-3-8B's
linears up to 64 rows, and at 65-128 rows 0.79-1.0x on the narrow ones (H200, bench/RESULTS.md,
FP8, session 30); at decode's 2-16 rows 16-row tiles with K split over the SMs (float32 partials
summed by a second kernel), 0.41-0.72x `_scaled_mm`'s time and 0.77-0.87x the skinny W8A16
kernel's (session 31); `bench/w8a8_mm.py` times them per shape. sm_90's FP8 MMAs
add in a narrower adder than float32, so the sums are promoted to float32 every K tile; at 16-row
tiles (too few rows for wgmma) Triton converts both operands to f16 for mma.sync instead.

Programs are ordered in groups of GROUP_M row blocks so that neighbours share weight tiles in L2.
No autotuning: the configs are functions of the shape (`w8a16_config`, `w8a8_config`: M, N, K
and the SM count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.dot import dot_operand, dot_upcast
from lmnb.runtime.kernels.fused.gemv import reduce_split_k, split_k_partials, split_k_span
from lmnb.runtime.kernels.interpreter import INTERPRETED
from lmnb.runtime.kernels.multiprocessors import multiprocessors
from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):
    """Program pid's output tile: its rows [BLOCK_M] and columns [BLOCK_N] and their masks
    (< M, < N); GROUP_M row blocks sweep the columns together."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _operand_pointers(X, W, offs_m, offs_n, stride_xm, stride_wn, BLOCK_K: tl.constexpr):
    """The first K step's x tile [BLOCK_M, BLOCK_K] and weight tile [BLOCK_K, BLOCK_N] (the
    weight's rows read K-major); each step moves both by BLOCK_K."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    return x_ptrs, w_ptrs


@triton.jit
def _load_operands(x_ptrs, w_ptrs, k, K, mask_m, mask_n, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """Step k's x and weight tiles, zero past M, N and K. Rows past M are masked, not pointed
    at row 0: many loads of one address cost time (H200, W8A8 over 17 rows of a 64-row tile:
    1.9x the 64 rows' time)."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
    else:
        mask_k = k + tl.arange(0, BLOCK_K) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    return x, w


@triton.jit
def _add_bias_and_store(acc, B, OUT, offs_m, offs_n, mask_m, mask_n, stride_om,
                        HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _program_slice(X, W, M, N, K, K_SPAN, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (grid axis 0: rows, columns and their masks) and K slice
    (axis 1: its index and columns [k_first, k_end)), and the pointers to its first x and
    weight tiles."""
    offs_m, offs_n, mask_m, mask_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
    pid_k = tl.program_id(1)
    k_first = pid_k * K_SPAN
    k_end = tl.minimum(k_first + K_SPAN, K)
    x_ptrs, w_ptrs = _operand_pointers(X + k_first, W + k_first, offs_m, offs_n, stride_xm,
                                       stride_wn, BLOCK_K)
    return offs_m, offs_n, mask_m, mask_n, pid_k, k_first, k_end, x_ptrs, w_ptrs


@triton.jit
def _store_sums(acc, B, OUT, PARTIAL, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """A tile's scaled float32 sums: whole K to OUT (+ bias); a K slice to PARTIAL
    [SPLIT_K, M, N], which `gemv.reduce_split_k` adds up (with the bias)."""
    if SPLIT_K == 1:
        _add_bias_and_store(acc, B, OUT, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS)
    else:
        part_ptrs = PARTIAL + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a16_mm_kernel(X, W, SCALE, B, OUT, PARTIAL, M, N, K, K_SPAN, stride_xm, stride_wn,
                     stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_K: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    wait_for_previous(USE_PDL)
    offs_m, offs_n, mask_m, mask_n, pid_k, k_first, k_end, x_ptrs, w_ptrs = _program_slice(
        X, W, M, N, K, K_SPAN, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_end, BLOCK_K):
        x, w = _load_operands(x_ptrs, w_ptrs, k, k_end, mask_m, mask_n, BLOCK_K, False)
        # e4m3 -> f16 is the hardware's conversion (and exact), f16 -> bf16 / f32 exact too
        w = w.to(tl.float16).to(X.dtype.element_ty)
        acc = tl.dot(dot_operand(x, UPCAST), dot_operand(w, UPCAST), acc,
                     input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(SCALE + offs_n, mask=mask_n, other=0.0)[None, :]
    _store_sums(acc, B, OUT, PARTIAL, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om,
                HAS_BIAS, SPLIT_K)


class W8A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # K slices summed by a second kernel
    swap_ab: bool = False  # W8A8 only: out^T = w @ x^T (few rows of x on the MMA's N side)


def _grid(m: int, n: int, cfg: W8A16Config) -> tuple[int]:
    """One program per [block_m, block_n] output tile (`_grouped_tile` orders them)."""
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def _by_rows(m: int, interpreted: W8A16Config, few: W8A16Config, more: W8A16Config, *,
             few_up_to: int = 64) -> W8A16Config:
    if INTERPRETED:  # small tiles: the interpreter's time grows with a tile's size
        return interpreted
    return few if m <= few_up_to else more


def w8a16_config(m: int, n: int, k: int, multiprocessors: int) -> W8A16Config:
    """The launch config for m rows against an [n, k] weight (a rule, not yet tuned on a GPU;
    up to 16 rows the W8A8 GEMM's split-K tiles, `decode_rows_config`)."""
    if m <= DECODE_ROWS and not INTERPRETED:
        return decode_rows_config(n, k, multiprocessors, swap_ab=False)
    return _by_rows(m, W8A16Config(16, 16, 16, 2, 1, 1), W8A16Config(64, 128, 128, 8, 4, 4),
                    W8A16Config(128, 128, 64, 8, 8, 4))


def w8a16_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: W8A16Config | None = None
             ) -> torch.Tensor:
    """x [M, K] (16/32-bit, rows contiguous) @ FP8 weight [N, K] with float32 scales [N] -> [M, N]
    in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn
    cfg = config or w8a16_config(m, n, k, multiprocessors(x.device) or 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _launch(_w8a16_mm_kernel, (x, weight, weight_scale), x, weight, bias, out, cfg,
            PRECISION="ieee" if x.dtype == torch.float32 or dot_upcast(x.dtype) else "tf32",
            UPCAST=dot_upcast(x.dtype))
    return out


def _launch(kernel: triton.JITFunction, operands: tuple[torch.Tensor, ...], x: torch.Tensor,
            weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: W8A16Config, **constexprs: object) -> None:
    """One of the GEMM kernels over x [M, K] (its `operands` first: x or its codes and scales,
    the weight and its scales) into out [M, N]; with `cfg.split_k` > 1 each K slice's sums go
    to float32 partials that `gemv.reduce_split_k` adds up (and the bias)."""
    (m, k), n = x.shape, weight.shape[0]
    k_span = split_k_span(k, cfg.split_k, cfg.block_k)
    partial = split_k_partials(out, m, n, cfg.split_k)
    b = bias if bias is not None else out  # unused without HAS_BIAS
    kernel[(_grid(m, n, cfg)[0], cfg.split_k)](
        *operands, b, out, partial, m, n, k, k_span, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
        **pdl_args(x.device))
    if cfg.split_k > 1:
        reduce_split_k(partial, bias, out)


@triton.jit
def _w8a8_mm_kernel(X, X_SCALE, W, W_SCALE, B, OUT, PARTIAL, M, N, K, K_SPAN, stride_xm,
                    stride_wn, stride_om,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr = False,
                    USE_PDL: tl.constexpr = False):
    """Program (tile, s) sums K slice s (K_SPAN columns); with SPLIT_K > 1 it writes its scaled
    float32 sums to PARTIAL [SPLIT_K, M, N] for `gemv.reduce_split_k`."""
    wait_for_previous(USE_PDL)
    offs_m, offs_n, mask_m, mask_n, pid_k, k_first, k_end, x_ptrs, w_ptrs = _program_slice(
        X, W, M, N, K, K_SPAN, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    if SWAP_AB:  # out^T = w @ x^T: the weight's rows fill the MMA's 64-row side
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_first, k_end, BLOCK_K):
            x, w = _load_operands(x_ptrs, w_ptrs, k, k_end, mask_m, mask_n, BLOCK_K, EVEN_K)
            acc_t = tl.dot(tl.trans(w), tl.trans(x), acc_t, max_num_imprecise_acc=BLOCK_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_first, k_end, BLOCK_K):
            x, w = _load_operands(x_ptrs, w_ptrs, k, k_end, mask_m, mask_n, BLOCK_K, EVEN_K)
            # sm_90's FP8 MMAs add in less than float32: promote to the float32 sum every tile,
            # as `_scaled_mm` (without fast accumulation) does
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    acc *= tl.load(X_SCALE + offs_m, mask=mask_m, other=0.0)[:, None]
    acc *= tl.load(W_SCALE + offs_n, mask=mask_n, other=0.0)[None, :]
    _store_sums(acc, B, OUT, PARTIAL, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om,
                HAS_BIAS, SPLIT_K)


DECODE_ROWS = 16  # up to these rows: 16-row tiles, K split to fill the SMs
MIN_PROGRAMS_AN_SM = 1.5
# Decode's rows with swapped operands (`W8A16Config.swap_ab`: FP8 wgmma m64n16k32 where 16-row
# tiles unswapped convert both operands to f16 for mma.sync; 16 x 64 x 256 tiles, slices of 8+ K
# steps): 2-8% faster a GEMM on the H200; a decode step 3-10% faster at batch 4-16 on the mean
# of four runs, a tie at 2 (bench/RESULTS.md, FP8, sessions 31-32); bench/fp8.py's
# "fp8-unswapped-rows" variant clears it. Read at each call.
W8A8_DECODE_SWAP_AB = True


def decode_rows_config(n: int, k: int, multiprocessors: int, *, swap_ab: bool) -> W8A16Config:
    """Tiles for decode's <= 16 rows against an [n, k] weight (`w8a8_config`'s rule): 16 x 64
    tiles, K halved while there are fewer than MIN_PROGRAMS_AN_SM programs an SM and a slice
    keeps 2 K steps of 128 (swapped: 8 of 256); 6 stages where split, else 4."""
    block_n, block_k, min_steps = (64, 256, 8) if swap_ab else (64, 128, 2)
    tiles = triton.cdiv(n, block_n)
    split = 1
    while (tiles * split < MIN_PROGRAMS_AN_SM * multiprocessors
           and k // (2 * split) >= min_steps * block_k):
        split *= 2
    stages = 4 if swap_ab or split == 1 else 6
    return W8A16Config(16, block_n, block_k, 8, 4, stages, split, swap_ab)


def w8a8_config(m: int, n: int, k: int, multiprocessors: int) -> W8A16Config:
    """The W8A8 launch config for m rows against an [n, k] weight on `multiprocessors` SMs.
    H200 sweeps (`bench/w8a8_mm.py --sweep`) over Llama-3-8B's linears:
    - up to 16 rows (decode batches), unswapped: 16 x 64 x 128 tiles over 4 warps, K split in
      two until there are 1.5 programs an SM (qkv and o 4 slices, down 4, gate_up none),
      6 stages where split (a program's few K steps all in flight), else 4 (gate_up's 448
      programs all resident); within 4% of the best swept tile at 2, 8 and 16 rows. Without
      the split qkv, o and down took 1.3-2.1x as long: 64-96 programs cannot keep the SMs'
      loads in flight.
      With `W8A8_DECODE_SWAP_AB` (the default): swapped 16 x 64 x 256 tiles, 4 stages, split
      while each slice keeps 8 K steps (qkv and o 2 slices, down 4, gate_up none).
    - 17-64 rows: 64 x 64 x 128 tiles, 5 stages, best or within 4% of the best for all four;
      up to 128 rows the same tiles (the grid the narrow weights that take it at those rows
      need, `fp8.takes_triton_w8a8`: o 1.27x `_scaled_mm` at 128 rows where 64 x 128 tiles
      gave 0.89x); past 128 rows no tile wins them all."""
    if m <= DECODE_ROWS and not INTERPRETED:
        return decode_rows_config(n, k, multiprocessors, swap_ab=W8A8_DECODE_SWAP_AB)
    return _by_rows(m, W8A16Config(16, 32, 32, 2, 1, 1), W8A16Config(64, 64, 128, 8, 4, 5),
                    W8A16Config(64, 128, 128, 8, 4, 4), few_up_to=128)


def w8a8_mm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
            weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
            config: W8A16Config | None = None) -> torch.Tensor:
    """FP8 rows codes [M, K] with float32 scales [M] or [M, 1] @ FP8 weight [N, K] with float32
    scales [N] -> [M, N] in out_dtype: `torch._scaled_mm(codes, weight.t(), scale_a=scale,
    scale_b=weight_scale)` (+ bias)."""
    assert codes.dim() == 2 and codes.stride(-1) == 1 and weight.stride(-1) == 1
    m, k = codes.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and codes.dtype == weight.dtype == torch.float8_e4m3fn
    assert scale.numel() == m and weight_scale.numel() == n
    cfg = config or w8a8_config(m, n, k, multiprocessors(codes.device) or 1)
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    even_k = k % split_k_span(k, cfg.split_k, cfg.block_k) == 0
    _launch(_w8a8_mm_kernel, (codes, scale.reshape(-1), weight, weight_scale.reshape(-1)),
            codes, weight, bias, out, cfg, EVEN_K=even_k, SWAP_AB=cfg.swap_ab)
    return out
