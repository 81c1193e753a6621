"""Decode attention that reads a shared prefix's KV once per group of requests (cascade attention).

Requests whose KV rows begin with the same slots (a radix-tree prefix they all hit: few-shot
prompts, forks of one document) are grouped. A *tile* is one group's prefix and up to
`members_per_tile` of its requests; the prefix is cut into parts, and each *work item* (one row
of `items`) is one tile's part: its program stacks the tile members' query heads of one KV head
(members x GQA group rows, tensor-core sized) and streams that part of the prefix KV once,
instead of once per request. Each request's own suffix goes through the ordinary split-K decode
kernel with its first `kv_skip[i]` tokens skipped, and the merge kernel folds both sets:

    partial_out [bs, heads, max_kv_splits + PREFIX_SPLITS, head_dim]
                 splits 0 .. S-1: the request's suffix (triton_decode.py; S the launch's split
                 count, `decode_config`'s max_splits at most)
                 splits S + part : part `part` of its group's prefix (this file)
    items       [num_items, 4 + members_per_tile] int64:
                 (leader request row, first token, end token, part, member rows..., -1 padding)
                 an item with end <= first is empty (graphs keep a fixed number of rows)
    kv_skip, prefix_parts [bs] int64: the prefix length and part count of request i's group
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.attend import attend_block
from lmnb.runtime.kernels.dot import dot_operand, dot_upcast

PREFIX_SPLITS = 8  # most parts a prefix is cut into
PART_MIN_TOKENS = 256  # shorter parts cost more in partial writes than they add in parallelism
BLOCK_M = 64  # query rows of a tile program (members x padded GQA group) the runtime plans
GRAPH_ITEMS = 128  # work items a captured graph launches (empty ones exit at once)
ITEM_HEAD = 4  # leader, first, end, part


class PrefixTile(NamedTuple):
    block_n: int  # KV tokens a step
    num_warps: int
    num_stages: int


# By tile height (query rows). 64: H100 sweep (bench/decode_kernel.py --shared --sweep), 32
# tokens x 4 warps x 2 stages. 32 and 16: H200 sweep (`--prefix-rows 64,32,16 --sweep`, the
# fork step 64:4:600:64 and 32:8:1000:48): 64 x 2 x 2 and 32 x 2 x 2.
PREFIX_TILES = {64: PrefixTile(32, 4, 2), 32: PrefixTile(64, 2, 2), 16: PrefixTile(32, 2, 2)}


# The heights a decode pass may plan its tiles in (graphs capture a variant for each, ~90 ms
# a batch size): with SMALL_TILE_ROWS among them, 16 rows while every group fits two 16-row
# tiles, else BLOCK_M. The kernel alone (H200, Llama-3, `bench/decode_kernel.py --shared
# G:M:P:S --prefix-rows 16`) gains 22% on forks of 4 (64:4:600:64), 8% on forks of 8 and loses
# 18% on a few-shot group of 32; end to end (`bench/vs_vllm.py` fork, same call) the fork run
# gained 0.6% (1.793 -> 1.782 s) for 2.2 s more of graph capture at start: not captured.
SMALL_TILE_ROWS = 16
TILE_HEIGHTS: tuple[int, ...] = (BLOCK_M,)
# A tile of one request reads its prefix as often as plain decode: `plan_items` keeps no group
# in such tiles (nothing saved), so a height whose tile holds fewer members is never planned.
MIN_TILE_MEMBERS = 2


def members_per_tile(num_heads: int, num_kv_heads: int, rows: int = BLOCK_M) -> int:
    """Requests a tile of `rows` query rows stacks (each brings its GQA group, padded to a
    power of two)."""
    return rows // triton.next_power_of_2(num_heads // num_kv_heads)


def tile_height(members: int, num_heads: int, num_kv_heads: int) -> int:
    """Query rows of a tile of `members` requests (the inverse of `members_per_tile`)."""
    return members * triton.next_power_of_2(num_heads // num_kv_heads)


def tile_heights(num_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """The heights of TILE_HEIGHTS whose tile holds MIN_TILE_MEMBERS requests or more (a GQA
    group of 16 query heads fills a 16-row tile alone)."""
    return tuple(rows for rows in TILE_HEIGHTS
                 if members_per_tile(num_heads, num_kv_heads, rows) >= MIN_TILE_MEMBERS)


def tile_rows_for(groups: Sequence[tuple[int, Sequence[int]]], num_heads: int,
                  num_kv_heads: int) -> int:
    """The tile height (one of `tile_heights`) a pass's (prefix length, rows) groups are
    planned in."""
    if SMALL_TILE_ROWS not in tile_heights(num_heads, num_kv_heads):
        return BLOCK_M
    members = members_per_tile(num_heads, num_kv_heads, SMALL_TILE_ROWS)
    return SMALL_TILE_ROWS if all(len(rows) <= 2 * members for _, rows in groups) else BLOCK_M


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """Device metadata of one decode pass's prefix groups (see the module docstring)."""

    kv_skip: torch.Tensor  # [bs] int64: leading KV tokens of request i read by its group
    prefix_parts: torch.Tensor  # [bs] int64: parts its group's prefix was cut into
    items: torch.Tensor  # [num_items, ITEM_HEAD + members_per_tile] int64

    @classmethod
    def view(cls, flat: torch.Tensor, *, batch_size: int, num_items: int,
             members: int) -> SharedPrefixes:
        """Views of a buffer laid out as `PrefixPlan.flat` (one host-to-device copy fills it)."""
        bs, width = batch_size, ITEM_HEAD + members
        return cls(kv_skip=flat[:bs], prefix_parts=flat[bs:2 * bs],
                   items=flat[2 * bs:2 * bs + num_items * width].view(num_items, width))


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """Host side of `SharedPrefixes` (plain lists)."""

    kv_skip: list[int]
    prefix_parts: list[int]
    items: list[list[int]]

    def flat(self, num_items: int, members: int) -> list[int]:
        """kv_skip, prefix_parts, then the items padded with empty ones to `num_items` rows."""
        width = ITEM_HEAD + members
        return (self.kv_skip + self.prefix_parts + [v for item in self.items for v in item]
                + [0] * ((num_items - len(self.items)) * width))


def plan_items(groups: Sequence[tuple[int, Sequence[int]]], *, batch_size: int, members: int,
               max_items: int) -> PrefixPlan:
    """The work items of `groups` = (prefix length, request rows) pairs, at most `max_items`:
    each group's tiles, each tile's prefix cut into parts of >= PART_MIN_TOKENS tokens while the
    items fit. When even one part per tile does not fit, the groups that save the most KV reads
    are kept and the others read their prefix per request (they skip nothing)."""
    def tiles_of(group: tuple[int, Sequence[int]]) -> int:
        return -(-len(group[1]) // members)

    def saved(group: tuple[int, Sequence[int]]) -> int:
        return group[0] * (len(group[1]) - tiles_of(group))

    kept, room = [], max_items
    for group in sorted(groups, key=saved, reverse=True):
        if tiles_of(group) <= room and saved(group) > 0:
            kept.append(group)
            room -= tiles_of(group)
    num_tiles = sum(map(tiles_of, kept))
    kv_skip, prefix_parts = [0] * batch_size, [0] * batch_size
    items: list[list[int]] = []
    for prefix_len, rows in kept:
        parts = max(1, min(PREFIX_SPLITS, max_items // max(num_tiles, 1),
                           prefix_len // PART_MIN_TOKENS))
        step = -(-prefix_len // parts)
        for row in rows:
            kv_skip[row], prefix_parts[row] = prefix_len, parts
        for first in range(0, len(rows), members):
            chunk = list(rows[first:first + members])
            padded = chunk + [-1] * (members - len(chunk))
            items += [[chunk[0], part * step, min((part + 1) * step, prefix_len), part, *padded]
                      for part in range(parts)]
    return PrefixPlan(kv_skip, prefix_parts, items)


@triton.jit
def _shared_prefix_kernel(
    Q, K, V, KV_INDPTR, KV_INDICES, ITEMS, PART_O, PART_LSE,
    scale,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_item,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MEMBERS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_OFFSET: tl.constexpr, HEAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    item = ITEMS + tl.program_id(0) * stride_item
    kv_head = tl.program_id(1)
    start = tl.load(item + 1)
    end = tl.load(item + 2)
    if end > start:
        leader = tl.load(item)
        part = tl.load(item + 3)
        kv_begin = tl.load(KV_INDPTR + leader)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        member_slot = offs_m // GROUP_P2
        in_group = offs_m % GROUP_P2
        member = tl.load(item + HEAD + member_slot, mask=member_slot < MEMBERS, other=-1)
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
            m_i, l_i, acc = attend_block(
                q, K, V, KV_INDICES + kv_begin, n, end, end, m_i, l_i, acc, scale, kv_head,
                stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                False, PRECISION, UPCAST)
        out = acc / l_i[:, None]
        slot = SPLIT_OFFSET + part
        tl.store(PART_O + member[:, None] * stride_pob + heads[:, None] * stride_poh
                 + slot * stride_pos + offs_d[None, :], out,
                 mask=valid[:, None] & mask_d[None, :])
        tl.store(PART_LSE + member * stride_plb + heads * stride_plh + slot, m_i + tl.log(l_i),
                 mask=valid)


def shared_prefix_partials(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           items: torch.Tensor, partial_out: torch.Tensor,
                           partial_lse: torch.Tensor, *, scale: float, split_offset: int,
                           precision: str) -> None:
    """Writes each item's members' partials over its part of the prefix (slots first..end of
    the leader's KV row) into split `split_offset + part` of the partial buffers. The items'
    width gives the tile height: (members x padded GQA group) rows, a key of PREFIX_TILES."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    members = items.shape[1] - ITEM_HEAD
    block_m = tile_height(members, num_heads, num_kv_heads)  # the height the plan chose
    assert block_m in PREFIX_TILES, f"{members}-member tiles: no {block_m}-row prefix tile"
    tile = PREFIX_TILES[block_m]
    _shared_prefix_kernel[(items.shape[0], num_kv_heads)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, items, partial_out, partial_lse,
        scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        items.stride(0),
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), MEMBERS=members,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m,
        BLOCK_N=tile.block_n, SPLIT_OFFSET=split_offset, HEAD=ITEM_HEAD,
        PRECISION=precision, UPCAST=dot_upcast(k_buffer.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
