"""Decode attention that reads a shared prefix's KV once per group of requests (cascade attention).

Requests whose KV rows begin with the same slots (a radix-tree prefix they all hit: few-shot
prompts, forks of one document) are grouped. A *tile* is one group's prefix and up to
`members_per_tile` of its requests; its program stacks those requests' query heads of one KV
head (members x GQA group rows, tensor-core sized) and streams the prefix KV once, instead of once
per request. Each request's own suffix goes through the ordinary split-K decode kernel with its
first `kv_skip[i]` tokens skipped, and the merge kernel folds both sets of partials:

    partial_out [bs, heads, max_kv_splits + prefix_splits, head_dim]
                 splits 0 .. max_kv_splits-1: the request's suffix (triton_decode.py)
                 splits max_kv_splits ..     : its group's prefix (this file)
    tiles       [num_tiles, 2 + members_per_tile] int64:
                 (leader request row, prefix length, member request rows..., -1 padding)
                 a tile of prefix length 0 is empty (graphs keep a fixed number of tiles)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.triton_decode import _split_len, dot_operand, dot_upcast

PREFIX_SPLITS = 8  # splits of a tile's prefix (long prefixes and few tiles keep SMs busy)
PREFIX_BLOCK_N = 64
BLOCK_M = 64  # query rows of a tile program: members x padded GQA group


def members_per_tile(num_heads: int, num_kv_heads: int) -> int:
    return BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads)


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """Device metadata of one decode pass's prefix groups (see the module docstring)."""

    kv_skip: torch.Tensor  # [bs] int64: leading KV tokens of request i attended in its tile
    tiles: torch.Tensor  # [num_tiles, 2 + members_per_tile] int64


MAX_GRAPH_TILES = 64  # tiles a captured graph launches (empty ones exit at once)


def graph_tiles(bs: int) -> int:
    """Tile rows of the graph of `bs` requests (every group has at least two requests)."""
    return min(bs // 2 + 1, MAX_GRAPH_TILES)


def plan_tiles(groups: Sequence[tuple[int, Sequence[int]]], *, batch_size: int, members: int,
               max_tiles: int | None = None) -> tuple[list[int], list[list[int]]]:
    """Host side: (kv_skip per request, tile rows) for `groups` = (prefix length, request rows)
    pairs; requests in no group skip nothing. With `max_tiles`, the groups that save the most
    KV reads are kept and the others read their prefix per request."""
    kv_skip = [0] * batch_size
    tiles: list[list[int]] = []
    if max_tiles is not None:
        def saved(group: tuple[int, Sequence[int]]) -> int:
            prefix_len, rows = group
            return prefix_len * (len(rows) - -(-len(rows) // members))

        kept, room = [], max_tiles
        for group in sorted(groups, key=saved, reverse=True):
            need = -(-len(group[1]) // members)
            if need <= room and saved(group) > 0:
                kept.append(group)
                room -= need
        groups = kept
    for prefix_len, rows in groups:
        for row in rows:
            kv_skip[row] = prefix_len
        for start in range(0, len(rows), members):
            chunk = list(rows[start:start + members])
            tiles.append([chunk[0], prefix_len, *chunk, *([-1] * (members - len(chunk)))])
    return kv_skip, tiles


@triton.jit
def _shared_prefix_kernel(
    Q, K, V, KV_INDPTR, KV_INDICES, TILES, PART_O, PART_LSE,
    scale,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_tile,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MEMBERS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_OFFSET: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(TILES + tile * stride_tile + 1)
    split_len = _split_len(prefix_len, PREFIX_SPLITS, MIN_SPLIT, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)
    if end > start:
        leader = tl.load(TILES + tile * stride_tile)
        kv_begin = tl.load(KV_INDPTR + leader)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        member_slot = offs_m // GROUP_P2
        in_group = offs_m % GROUP_P2
        member = tl.load(TILES + tile * stride_tile + 2 + member_slot,
                         mask=member_slot < MEMBERS, other=-1)
        valid = (member >= 0) & (in_group < GROUP)
        member = tl.where(valid, member, 0)
        heads = kv_head * GROUP + in_group
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + member[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)
        q = dot_operand(q.to(K.dtype.element_ty), UPCAST)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n in range(start, end, BLOCK_N):
            cols = n + offs_n
            mask_n = cols < end
            slots = tl.load(KV_INDICES + kv_begin + cols, mask=mask_n, other=0)
            k = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            k = dot_operand(k, UPCAST)
            qk = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            v = dot_operand(v, UPCAST)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        slot = SPLIT_OFFSET + split
        tl.store(PART_O + member[:, None] * stride_pob + heads[:, None] * stride_poh
                 + slot * stride_pos + offs_d[None, :], out,
                 mask=valid[:, None] & mask_d[None, :])
        tl.store(PART_LSE + member * stride_plb + heads * stride_plh + slot, m_i + tl.log(l_i),
                 mask=valid)


def shared_prefix_partials(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           tiles: torch.Tensor, partial_out: torch.Tensor,
                           partial_lse: torch.Tensor, *, scale: float, split_offset: int,
                           precision: str) -> None:
    """Writes each tile member's prefix partials into splits `split_offset ..` of the partial
    buffers (the prefix is the first `tiles[t, 1]` slots of the leader's KV row)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    members = tiles.shape[1] - 2
    assert members == members_per_tile(num_heads, num_kv_heads), "tiles of another model shape"
    _shared_prefix_kernel[(tiles.shape[0], num_kv_heads, PREFIX_SPLITS)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, tiles, partial_out, partial_lse,
        scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        tiles.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), MEMBERS=members,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=BLOCK_M,
        BLOCK_N=PREFIX_BLOCK_N, SPLIT_OFFSET=split_offset, PREFIX_SPLITS=PREFIX_SPLITS,
        MIN_SPLIT=PREFIX_BLOCK_N, PRECISION=precision, UPCAST=dot_upcast(k_buffer.dtype),
        num_warps=4, num_stages=2,
    )
