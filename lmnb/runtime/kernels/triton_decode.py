"""Decode attention over the token-level KV pool (page size 1): split-K flash-decoding in Triton.

One query token per request. Stage 1 runs a program per (request, KV head, split): the query heads
sharing that KV head (GQA group, padded to BLOCK_H rows) attend to one chunk of the request's KV
with an online softmax and store the chunk's normalised output and log-sum-exp. Stage 2 runs a
program per (request, block of query heads) and merges the splits. A request whose KV is one
split (most of a busy batch's, see `decode_config`) gets its output from stage 1, and stage 2
skips it. With a shared prefix (`shared_prefix.py`) and a launch of one split, stage 1 folds the
prefix's partials into its suffix's output itself, and stage 2 is not launched.

The split count is a launch constant (`max_kv_splits`, capped by the config's `max_splits`, which
shrinks as the batch grows): a request of kv_len tokens uses
cdiv(kv_len, split_len) of them, split_len = max(cdiv(kv_len, max_kv_splits), MIN_SPLIT_LEN)
rounded up to BLOCK_N, computed inside both kernels from kv_indptr, so no launch reads a device
value back and CUDA graphs can capture both stages.

    partial_out  [bs, heads, max_kv_splits, head_dim]  float32
    partial_lse  [bs, heads, max_kv_splits]            float32

FP8 KV (`KV_FP8`, float8_e4m3fn pools with one float32 scale per slot and KV head, `KVStorage`):
K/V tiles are converted in registers to q's dtype, which stays the model's (q is not rounded to the
pool's dtype); K's scales multiply the logits' columns, V's the probabilities' columns. The scales
may have any strides; `KVStorage` keeps them head-major ([kv_heads, slots] memory seen as a
[slots, kv_heads] view), so a program (one KV head) gathers a tile's scales from a few sectors of
one row (a request's slots are mostly runs) instead of one 32-byte sector per slot. At the busiest
level `decode_config` gives FP8 pools the 16-bit tile with 3 stages (an H100 sweep; twice the
tokens over twice the warps was slower).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.attend import (
    attend_block,
    attend_slots,
    fp8_pool_compute,
    fp8_pool_query,
)
from lmnb.runtime.kernels.dot import dot_operand, dot_upcast
from lmnb.runtime.kernels.multiprocessors import multiprocessors
from lmnb.runtime.kernels.pdl import launch_args as pdl_args
from lmnb.runtime.kernels.pdl import wait_for_previous
from lmnb.runtime.kernels.shared_prefix import PREFIX_SPLITS, SharedPrefixes, shared_prefix_partials

MIN_SPLIT_LEN = 64


@triton.jit
def _split_len(kv_len, MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    split_len = tl.maximum(tl.cdiv(kv_len, MAX_SPLITS), MIN_SPLIT)
    return tl.cdiv(split_len, BLOCK_N) * BLOCK_N


@triton.jit
def _decode_partial_kernel(
    Q, K, V, K_SCALE, V_SCALE, KV_INDPTR, KV_INDICES, KV_SKIP, PREFIX_PARTS, PART_O, PART_LSE,
    OUT, scale, stride_st, stride_sh,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SKIP: tl.constexpr,
    KV_FP8: tl.constexpr = False, PREFETCH: tl.constexpr = False, K_ROWS: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    if HEADS_FIRST:  # a request's KV heads run side by side: they read each token's whole row
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_begin = tl.load(KV_INDPTR + req)
    kv_len = tl.load(KV_INDPTR + req + 1) - kv_begin
    if HAS_SKIP:  # the first KV_SKIP[req] tokens are a shared prefix attended to elsewhere
        skip = tl.load(KV_SKIP + req)
        kv_begin += skip
        kv_len -= skip
    split_len = _split_len(kv_len, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM

    if end > start:
        q = tl.load(Q + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:  # FP8 pool: K/V converted to the dtype of fp8_pool_query's q
            q, q_scale = fp8_pool_query(q)
        else:
            q = dot_operand(q.to(K.dtype.element_ty), UPCAST)
            q_scale = tl.full([BLOCK_H], 1.0, dtype=tl.float32)  # unread
        k_scales = K_SCALE + kv_head * stride_sh  # this KV head's (FP8 pools)
        v_scales = V_SCALE + kv_head * stride_sh
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        slots_of = KV_INDICES + kv_begin
        if PREFETCH:  # the next block's slots load while this block's K/V are in flight
            cols = start + offs_n
            slots = tl.load(slots_of + cols, mask=cols < end, other=0)
            for _ in range(start, end, BLOCK_N):
                next_cols = cols + BLOCK_N
                next_slots = tl.load(slots_of + next_cols, mask=next_cols < end, other=0)
                m_i, l_i, acc = attend_slots(
                    q, K, V, slots, cols, cols < end, end, m_i, l_i, acc, scale, kv_head,
                    stride_kt, stride_kh, stride_vt, stride_vh, offs_d, mask_d,
                    False, PRECISION, UPCAST, KV_FP8, K_ROWS, k_scales, v_scales, stride_st,
                    q_scale, HEAD_DIM)
                cols, slots = next_cols, next_slots
        else:
            for n in range(start, end, BLOCK_N):
                m_i, l_i, acc = attend_block(
                    q, K, V, slots_of, n, end, end, m_i, l_i, acc, scale, kv_head,
                    stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                    False, PRECISION, UPCAST, KV_FP8, K_ROWS, k_scales, v_scales, stride_st,
                    q_scale, HEAD_DIM)
        out = acc / l_i[:, None]
        mask = mask_h[:, None] & mask_d[None, :]
        if HAS_SKIP and MAX_SPLITS == 1:  # fold in the prefix's partials (written before)
            top = m_i + tl.log(l_i)
            weight = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
            for part in range(tl.load(PREFIX_PARTS + req)):
                slot = MAX_SPLITS + part
                lse = tl.load(PART_LSE + req * stride_plb + heads * stride_plh + slot,
                              mask=mask_h, other=float("-inf"))
                part_out = tl.load(PART_O + req * stride_pob + heads[:, None] * stride_poh
                                   + slot * stride_pos + offs_d[None, :], mask=mask, other=0.0)
                new_top = tl.maximum(top, lse)
                old_scale, part_scale = tl.exp(top - new_top), tl.exp(lse - new_top)
                out = out * old_scale[:, None] + part_out * part_scale[:, None]
                weight = weight * old_scale + part_scale
                top = new_top
            tl.store(OUT + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     (out / weight[:, None]).to(OUT.dtype.element_ty), mask=mask)
        elif HAS_SKIP or split_len < kv_len:  # partials for the merge kernel
            tl.store(PART_O + req * stride_pob + heads[:, None] * stride_poh
                     + split * stride_pos + offs_d[None, :], out, mask=mask)
            tl.store(PART_LSE + req * stride_plb + heads * stride_plh + split,
                     m_i + tl.log(l_i), mask=mask_h)
        else:  # the request's only split: its output, and the merge kernel skips it
            tl.store(OUT + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(OUT.dtype.element_ty), mask=mask)


def partial_kernel_types(*, q: str, kv: str, kv_scales: str = "*fp32",
                         index: str = "*i32") -> dict[str, str]:
    """`_decode_partial_kernel`'s tensor and scalar arguments as Triton signature types, for
    compiling it ahead of time for another GPU (tests, `bench/kernel_resources.py`): q (also the
    output's) and kv like "*bf16", kv_scales the FP8 pool's scales, index the index tensors'."""
    strides = ("stride_st", "stride_sh", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
               "stride_vt", "stride_vh", "stride_pob", "stride_poh", "stride_pos", "stride_plb",
               "stride_plh", "stride_ot", "stride_oh")
    return {"Q": q, "K": kv, "V": kv, "K_SCALE": kv_scales, "V_SCALE": kv_scales,
            "KV_INDPTR": index, "KV_INDICES": index, "KV_SKIP": index, "PREFIX_PARTS": index,
            "PART_O": "*fp32", "PART_LSE": "*fp32", "OUT": q, "scale": "fp32",
            **{name: "i32" for name in strides}}


@triton.jit
def _decode_merge_kernel(
    PART_O, PART_LSE, KV_INDPTR, KV_SKIP, PREFIX_PARTS, OUT,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ot, stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MIN_SPLIT: tl.constexpr,
    HAS_SKIP: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (request, block of BLOCK_HEADS query heads): most requests of a busy batch have
    one split and exit at once, so few programs a request keep the launch cheap."""
    wait_for_previous(USE_PDL)
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    kv_len = tl.load(KV_INDPTR + req + 1) - tl.load(KV_INDPTR + req)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    if HAS_SKIP:
        kv_len -= tl.load(KV_SKIP + req)
    split_len = _split_len(kv_len, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
    # a request of one split (and no shared prefix) was written out by the partial kernel
    if HAS_SKIP or split_len < kv_len:
        used = offs_s < tl.cdiv(kv_len, split_len)  # split 0 always holds a token
        if HAS_SKIP:  # splits MAX_SPLITS.. hold the shared prefix's partials (shared_prefix.py)
            prefix_used = tl.load(PREFIX_PARTS + req)
            used = used | ((offs_s >= MAX_SPLITS) & (offs_s < MAX_SPLITS + prefix_used))
        mask_hs = (heads < num_heads)[:, None] & used[None, :]  # [BLOCK_HEADS, BLOCK_S]
        lse = tl.load(PART_LSE + req * stride_plb + heads[:, None] * stride_plh
                      + offs_s[None, :], mask=mask_hs, other=float("-inf"))
        parts = tl.load(PART_O + req * stride_pob + heads[:, None, None] * stride_poh
                        + offs_s[None, :, None] * stride_pos + offs_d[None, None, :],
                        mask=mask_hs[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
                        other=0.0)  # [BLOCK_HEADS, BLOCK_S, BLOCK_D]
        top = tl.max(lse, 1)
        weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])
        out = tl.sum(weight[:, :, None] * parts, 1) / tl.maximum(tl.sum(weight, 1), 1e-30)[:, None]
        tl.store(OUT + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty),
                 mask=(heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :])


class DecodeConfig(NamedTuple):
    block_n: int  # KV tokens per inner step
    min_split: int  # fewest KV tokens a split is given (short contexts use fewer splits)
    num_warps: int
    num_stages: int
    max_splits: int = 16  # the launch's split dimension at most (empty programs cost too)
    prefetch: bool = False  # load the next block's slots one iteration ahead
    k_rows: bool = False  # load K token-major and transpose it for the dot
    heads_first: bool = False  # grid (KV head, request, split): a token's heads read together


# (request, KV head) programs above which splitting a request's KV buys no parallelism, only
# partial writes and a merge: the split length then grows (fewer, longer splits).
_BUSY_PROGRAMS = (128, 512, 2048)
_BUSY_PER_SM = 2  # the busy tiles' programs resident on a multiprocessor (registers bound it)


def decode_config(head_dim: int, dtype: torch.dtype, *, batch_size: int = 1,
                  num_kv_heads: int = 1, shared: bool = False,
                  sm_count: int | None = None) -> DecodeConfig:
    """Tile sizes by head size and element width (smaller KV tiles for large fp32 heads, three
    stages for FP8 pools at the busiest level), the shortest split by how many (request, KV
    head) programs the batch has already. `shared`: the suffixes of requests whose shared
    prefix is read apart (`shared_prefix.py`), mostly short. `sm_count`: the GPU's
    multiprocessors, where known (a busy batch that fits two waves takes a smaller tile)."""
    programs = batch_size * num_kv_heads
    level = sum(programs >= busy for busy in _BUSY_PROGRAMS)
    if shared:
        # H200 sweep (`bench/decode_kernel.py --shared G:M:P:S --sweep --shared-sweep suffix`,
        # Llama-3): 32-token tiles over 2 warps, 1 stage, per layer with the prefix kernel and
        # the merge: few-shot 8:32:1500:24 114 us against 131+ for the batch's busy tile, fork
        # 64:4:600:64 148 us; every 32-token tile within 1%, 128-token tiles the slowest. The
        # suffixes are short: the split grid shrinks with the batch as the plain kernel's does
        # (a 16-split grid at batch 256 is 15 empty programs per request and KV head).
        return DecodeConfig(32, MIN_SPLIT_LEN, 2, 1, (16, 4, 2, 1)[level])
    if dtype == torch.float8_e4m3fn:
        # H100 sweep (`bench/decode_kernel.py --kv-fp8 --sweep`, Llama-3, batch 256, contexts
        # 100-2,048, 600 MB of FP8 K/V and scales a layer): 128-token tiles over 4 warps with 3
        # stages 322 us (1.86 TB/s; bf16's tiles 411 us on 1,163 MB), the 16-bit busy tile 349,
        # 2x tokens over 2x warps 471. Below the busiest level the 16-bit tiles (not swept).
        # With the float16 dots and V read as words (`attend.py`): H200, batch 234, this pick
        # 343.6 -> 275.2 us a layer beside the old loop; re-swept, 36 configs, the best 273.3 (all
        # 128-token 4-warp tiles within 1.5%, 64-token 283-298, 128/8 warps 370, 256-token 410+).
        base = decode_config(head_dim, torch.bfloat16, batch_size=batch_size,
                             num_kv_heads=num_kv_heads)  # the 16-bit pick without the waves' rule
        if base.block_n == 128:  # the busiest level
            return base._replace(num_stages=3, prefetch=False, k_rows=False, max_splits=2,
                                 heads_first=False)
        return base
    wide = triton.next_power_of_2(head_dim) * torch.empty((), dtype=dtype).element_size() > 512
    # H100, triton 3.6, fp16 head_dim 128, in a CUDA graph: 2 warps beat 4 by up to 1.6x at
    # batch 1 (2k MHA 26 vs 36 us, 8k GQA 28 vs 46 us) and match it at batch 32. The split
    # dimension shrinks with the batch: at batch 256 (contexts 100-2,048) a grid of 2 splits
    # beats 16 by 2% (Llama-3) and 3% (Llama-2): the empty programs of a wide grid are not free.
    # At the busiest level, 128-token tiles over 4 warps with the next block's slots prefetched
    # and K loaded token-major: 414.0 -> 410.8 us a layer (Llama-3, batch 256; FA3 403.8).
    # From 512 programs the grid runs a request's KV heads side by side (each token's row is
    # read whole), and from 2,048 each request is one split (no partials, no merge): H200,
    # contexts 100-2,048 laid out by 600 decode steps in a 243k/500k-slot pool, a layer:
    # Llama-2 batch 234 976.5 -> 950.7 us (FlashInfer's page-1 decode 962.9), Llama-3 batch
    # 256 283.3 -> 274.5 us, Llama-2 batch 32 (heads first only) 155.6 -> 154.5 us.
    # Unless the busy batch fits two waves of 2 programs an SM (512-528 programs on 132 SMs):
    # then 64-token tiles over 4 warps in one split are faster (the 128-token tile spills 784 B
    # a thread with triton 3.6, they none: `bench/kernel_resources.py`). H200, contexts laid
    # out by 48 decode steps, a layer: Llama-3 batch 64, 512-560
    # 46.7 -> 39.3 us, 1,500-2,048 122.2 -> 115.7; Llama-2 batch 16, 1,000-2,048 113.0 -> 107.6;
    # past two waves they lose (Llama-3 batch 72 +1%, 80 +8%, 96 +7%).
    if level >= 2 and not wide and sm_count is not None and programs <= 2 * _BUSY_PER_SM * sm_count:
        return DecodeConfig(64, 16 * MIN_SPLIT_LEN, 4, 2, 1, prefetch=True, k_rows=True,
                            heads_first=True)
    if level >= 2 and not wide:
        return DecodeConfig(128, 16 * MIN_SPLIT_LEN, 4, 2, 2 if level == 2 else 1,
                            prefetch=True, k_rows=True, heads_first=True)
    level = min(level, 2)
    return DecodeConfig(32 if wide else 64, (MIN_SPLIT_LEN, 4 * MIN_SPLIT_LEN,
                                             16 * MIN_SPLIT_LEN)[level], 2, 2, (16, 4, 2)[level])


def query_rows(group: int) -> int:
    """The query rows a stage-1 program stacks (BLOCK_H): a GQA group's heads, padded to a
    16-row tensor-core tile."""
    return max(16, triton.next_power_of_2(group))


def partial_buffers(bs: int, num_heads: int, head_dim: int, max_kv_splits: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([bs, heads, splits, head_dim], [bs, heads, splits]) float32 scratch for stage 1."""
    return (torch.empty((bs, num_heads, max_kv_splits, head_dim), dtype=torch.float32,
                        device=device),
            torch.empty((bs, num_heads, max_kv_splits), dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     partial_out: torch.Tensor, partial_lse: torch.Tensor, *, scale: float,
                     max_kv_splits: int, config: DecodeConfig | None = None,
                     shared: SharedPrefixes | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[i] = softmax(q[i] k^T * scale) v over request i's KV slots, per head (GQA-aware).

    q, out [bs, heads, head_dim]; k_buffer, v_buffer [slots, kv_heads, head_dim] (last dim
    contiguous); kv_indptr [bs + 1]; every request has at least one KV token. partial_out /
    partial_lse come from `partial_buffers` with at least bs rows and `max_kv_splits` splits
    (`max_kv_splits + PREFIX_SPLITS` with `shared`: then each group's prefix is read once per
    tile, see `shared_prefix.py`). An FP8 pool needs its `kv_scales` (k_scales, v_scales)
    [slots, kv_heads] float32 (`KVStorage.scales`).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    config = config or decode_config(head_dim, k_buffer.dtype, batch_size=bs,
                                     num_kv_heads=num_kv_heads, shared=shared is not None,
                                     sm_count=multiprocessors(q.device))
    block_h = query_rows(group)
    kv_fp8 = k_buffer.dtype == torch.float8_e4m3fn
    compute = fp8_pool_compute(q.dtype) if kv_fp8 else k_buffer.dtype  # what the dots multiply
    assert shared is None or not kv_fp8, "shared-prefix decode reads 16/32-bit KV only"
    assert not kv_fp8 or kv_scales is not None, "an FP8 pool needs its scales"
    assert not kv_fp8 or (v_buffer.stride(-1) == 1 and v_buffer.stride(0) % 4 == 0
                          and v_buffer.stride(1) % 4 == 0), "FP8 V rows are read as int32 words"
    k_scale, v_scale = kv_scales if kv_fp8 else (kv_indptr, kv_indptr)  # unread without FP8
    scale_strides = k_scale.stride() if kv_fp8 else (0, 0)
    assert not kv_fp8 or (k_scale.shape == k_buffer.shape[:2]
                          and v_scale.stride() == k_scale.stride()), "scales [slots, kv_heads]"
    precision = "ieee" if compute == torch.float32 else "tf32"
    for t in (q, k_buffer, v_buffer, out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    # unread without `shared`
    kv_skip, prefix_parts = (kv_indptr, kv_indptr) if shared is None else (shared.kv_skip,
                                                                          shared.prefix_parts)
    prefix_splits = 0
    max_kv_splits = min(max_kv_splits, config.max_splits)
    if shared is not None:  # the prefix's partials sit after the suffix's splits
        prefix_splits = PREFIX_SPLITS
        assert partial_out.shape[2] >= max_kv_splits + prefix_splits, "partials too narrow"
        shared_prefix_partials(
            q, k_buffer, v_buffer, kv_indptr, kv_indices, shared.items, partial_out,
            partial_lse, scale=scale, split_offset=max_kv_splits, precision=precision)
    grid = ((num_kv_heads, bs, max_kv_splits) if config.heads_first
            else (bs, num_kv_heads, max_kv_splits))
    _decode_partial_kernel[grid](
        q, k_buffer, v_buffer, k_scale, v_scale, kv_indptr, kv_indices, kv_skip, prefix_parts,
        partial_out, partial_lse, out, scale, *scale_strides,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=config.block_n, MAX_SPLITS=max_kv_splits, MIN_SPLIT=config.min_split,
        PRECISION=precision, UPCAST=dot_upcast(compute), HAS_SKIP=shared is not None,
        KV_FP8=kv_fp8, PREFETCH=config.prefetch, K_ROWS=config.k_rows,
        HEADS_FIRST=config.heads_first,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(q.device),
    )
    if max_kv_splits == 1:  # every output came from stage 1 (a suffix folds its prefix)
        return out
    block_s = triton.next_power_of_2(max_kv_splits + prefix_splits)
    # heads a merge program takes: its [heads, splits, head_dim] partials ~8k floats at most
    block_heads = min(triton.next_power_of_2(num_heads), max(1, 8192 // (block_s * block_d)))
    _decode_merge_kernel[(bs, triton.cdiv(num_heads, block_heads))](
        partial_out, partial_lse, kv_indptr, kv_skip, prefix_parts, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=config.block_n, MAX_SPLITS=max_kv_splits,
        BLOCK_S=block_s, MIN_SPLIT=config.min_split, HAS_SKIP=shared is not None,
        BLOCK_HEADS=block_heads, num_warps=4, num_stages=1, **pdl_args(q.device),
    )
    return out
