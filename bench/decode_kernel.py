"""Decode attention alone at the offline workload's shapes: lmnb's Triton split-K kernel over a
sweep of launch configurations, FlashInfer's paged decode (page size 1, as lmnb's FlashInfer
backend calls it, and 16) and, when vLLM's wheel is importable, its FlashAttention-3 over a block
table of 16-token pages, each as achieved KV bandwidth (bytes of K and V read / kernel time).

    python bench/decode_kernel.py --device cuda --model llama3 --batch 256
    python bench/decode_kernel.py --device cuda --model llama2 --sweep
    python bench/decode_kernel.py --device cuda --model llama3 --batch 256 --kv-fp8 --sweep

The batch's context lengths are drawn uniformly from [--min-len, --max-len] (seeded); each
request's KV slots are one contiguous run of the pool, the runs in shuffled order (a pool some
time into a run), or every slot scattered with `--scatter`. `--decoded N` lays the last N tokens of
every request out as decode steps allocate them (step s takes one run of batch-size slots, request i
its i-th slot), and `--pool-slots` spreads the runs over a pool that large (the real one holds
~450k tokens of Llama-3-8B on an H100), both as the offline run's pool looks.

`--kv-fp8`: the same batch in an FP8 pool (`kv_cache_dtype="fp8_e4m3"`: e4m3 K/V quantized as
`KVStorage.set_kv` does, float32 scales per slot and KV head, head-major as `KVStorage` keeps them;
`--slot-major-scales` lays them [slots, kv_heads] instead), q in the model's dtype; GB/s counts the
bytes the kernel needs (the FP8 K/V and their scales) and the sweep covers FP8 tiles (more tokens,
warps, stages, float16 dots). FA3 rows are 16-bit only and left out; with the flashinfer peer the
same K/V also go to a pool of fixed scales (one for K, one for V: `KVStorage(fp8_scales="tensor")`,
what lmnb's FlashInfer backend reads), timed through FlashInfer (page size 1, tensor cores as the
backend picks them) and through Triton (its scales seen with slot stride 0); their GB/s count only
the FP8 bytes, and their error includes their own rounding (against the per-token pool's values).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, format_table, write_json  # noqa: E402

MODELS = {  # (query heads, KV heads, head_dim, dtype)
    "llama3": (32, 8, 128, torch.bfloat16),
    "llama2": (32, 32, 128, torch.float16),
}


class Batch:
    def __init__(self, *, lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scatter: bool, device: torch.device, seed: int,
                 decoded: int = 0, pool_slots: int = 0, kv_fp8: bool = False,
                 slot_major_scales: bool = False) -> None:
        rng = random.Random(seed)
        self.lens = lens
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        total = sum(lens)
        slots = max(total + 16 * len(lens) + 16, pool_slots)
        self.k = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        tails = [min(decoded, n - 1) for n in lens]  # tokens of each request laid out by steps
        order = list(range(len(lens)))
        rng.shuffle(order)
        gap = (slots - total - 1) // (len(lens) + 1)  # free slots between runs in a big pool
        starts = [0] * len(lens)
        cursor = 1  # slot 0 is the padding slot
        for i in order:
            starts[i] = cursor
            cursor += lens[i] - tails[i] + gap
        rows = [list(range(starts[i], starts[i] + n - tails[i])) for i, n in enumerate(lens)]
        for step in range(max(tails, default=0)):  # one run of slots per decode step
            stepping = [i for i, t in enumerate(tails) if t > step]
            for offset, i in enumerate(stepping):
                rows[i].append(cursor + offset)
            cursor += len(stepping)
        assert cursor <= slots, "the pool is too small for this layout"
        indices = torch.tensor([slot for row in rows for slot in row])
        if scatter:
            perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)) + 1
            indices = perm
        self.kv_indices = indices.to(device=device, dtype=torch.int32)
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                                      device=device)
        self.q = torch.randn(len(lens), heads, head_dim, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * total * kv_heads * head_dim * self.k.element_size()
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        if kv_fp8:
            self.kv_scales = self._to_fp8(slot_major_scales)
            self.kv_bytes = 2 * total * kv_heads * (head_dim + 4)  # e4m3 K/V + float32 scales

    def _to_fp8(self, slot_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V -> e4m3 with per-(slot, head) scales as `KVStorage` writes them (head-major, or
        [slots, kv_heads] contiguous with `slot_major`)."""
        from lmnb.runtime.memory.kv_storage import quantize_heads

        scales = []
        for name in ("k", "v"):
            quantized, scale = quantize_heads(getattr(self, name))
            setattr(self, name, quantized)
            scales.append(scale.contiguous() if slot_major else scale.t().contiguous().t())
        return scales[0], scales[1]

    def kv_float(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """K or V rows `idx` [n] in float32 (dequantized in an FP8 pool)."""
        rows = getattr(self, name)[idx].float()
        if self.kv_scales is None:
            return rows
        return rows * self.kv_scales[name == "v"][idx][..., None]

    def reference(self, rows: int = 4) -> torch.Tensor:
        """Attention of the first `rows` requests in float32."""
        outs = []
        group = self.heads // self.kv_heads
        for i in range(min(rows, len(self.lens))):
            idx = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]].long()
            k = self.kv_float("k", idx).repeat_interleave(group, 1)  # [n, heads, d]
            v = self.kv_float("v", idx).repeat_interleave(group, 1)
            scores = torch.einsum("hd,nhd->hn", self.q[i].float(), k) * self.scale
            outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
        return torch.stack(outs)


def time_kernel(run: Callable[[], Any]) -> float:
    """Median milliseconds of `run` (a CUDA graph of 10 calls, the L2 not flushed: the KV of a
    batch this size is far larger than it)."""
    import triton.testing

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            run()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 10


def triton_runs(batch: Batch, sweep: bool, split_counts: tuple[int, ...] = (16,),
                extra_tiles: tuple[tuple[int, int, int], ...] = (),
                split_grids: tuple[tuple[int, int], ...] = (), heads_first: bool = False
                ) -> list[tuple[str, Callable[[], Any], dict]]:
    """The default config, the sweep's grid with `sweep`, each (block_n, warps, stages) of
    `extra_tiles` and each (max_splits, min_split) of `split_grids` with the default's other
    fields."""
    from lmnb.runtime.kernels import triton_decode as td

    out = torch.empty_like(batch.q)
    default = td.decode_config(batch.head_dim, batch.k.dtype, batch_size=len(batch.lens),
                               num_kv_heads=batch.kv_heads,
                               sm_count=td.multiprocessors(batch.q.device))
    configs = [("default", default)]
    if sweep and batch.kv_scales is not None:  # FP8 tiles: a 16-bit tile's bytes and more
        tiles = ((64, 2, 2), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 2), (256, 4, 2),
                 (256, 8, 2), (256, 8, 3), (256, 16, 2), (512, 16, 2))
        for block_n, warps, stages in tiles:
            configs.append((f"n{block_n} w{warps} s{stages}",
                            default._replace(block_n=block_n, num_warps=warps, num_stages=stages)))
        for prefetch, k_rows in itertools.product((False, True), repeat=2):
            configs.append((f"default{' prefetch' * prefetch}{' k_rows' * k_rows}",
                            default._replace(prefetch=prefetch, k_rows=k_rows)))
    elif sweep:  # tiles x the loop's variants (the split length matters < 1%: the default's)
        tiles = ((32, 2, 2), (32, 2, 3), (64, 2, 2), (64, 2, 3), (64, 2, 4), (64, 4, 2),
                 (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2))
        for (block_n, warps, stages), prefetch, k_rows in itertools.product(
                tiles, (False, True), (False, True)):
            configs.append((f"n{block_n} w{warps} s{stages}{' prefetch' * prefetch}"
                            f"{' k_rows' * k_rows}",
                            default._replace(block_n=block_n, num_warps=warps, num_stages=stages,
                                             prefetch=prefetch, k_rows=k_rows)))
    if heads_first:
        for name, config in list(configs):
            configs.append((f"{name} heads_first", config._replace(heads_first=True)))
    for block_n, warps, stages in extra_tiles:
        configs.append((f"n{block_n} w{warps} s{stages} (default's loop)",
                        default._replace(block_n=block_n, num_warps=warps, num_stages=stages)))
    for max_splits, min_split in split_grids:
        for order in (False, True) if heads_first else (False,):
            configs.append((f"max_splits {max_splits} min_split {min_split}"
                            f"{' heads_first' * order}",
                            default._replace(max_splits=max_splits, min_split=min_split,
                                             heads_first=order)))
    runs = []
    for name, config in configs:
        for splits in split_counts if not name.startswith("max_splits") else (config.max_splits,):
            part_o, part_lse = td.partial_buffers(len(batch.lens), batch.heads, batch.head_dim,
                                                  splits, batch.q.device)

            def run(config: td.DecodeConfig = config, part_o: torch.Tensor = part_o,
                    part_lse: torch.Tensor = part_lse, splits: int = splits) -> torch.Tensor:
                return td.decode_attention(batch.q, batch.k, batch.v, out, batch.kv_indptr,
                                           batch.kv_indices, part_o, part_lse, scale=batch.scale,
                                           max_kv_splits=splits, config=config,
                                           kv_scales=batch.kv_scales)
            runs.append((f"triton {name} splits {splits}", run,
                         {**config._asdict(), "max_kv_splits": splits}))
    return runs


class SharedBatch:
    """`groups` x `members` requests: each group's members share a `prefix`-token KV run and
    have `suffix` tokens of their own (a fork's or a few-shot batch's decode step)."""

    def __init__(self, *, groups: int, members: int, prefix: int, suffix: int, heads: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        from lmnb.runtime.kernels import shared_prefix as sp

        bs = groups * members
        slots = groups * prefix + bs * suffix + 1
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.k = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        rows, cursor = [], 1
        for _ in range(groups):
            shared = torch.arange(cursor, cursor + prefix)
            cursor += prefix
            for _ in range(members):
                rows.append(torch.cat((shared, torch.arange(cursor, cursor + suffix))))
                cursor += suffix
        self.kv_indices = torch.cat(rows).to(device=device, dtype=torch.int32)
        self.lens = [prefix + suffix] * bs
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(self.lens)], dtype=torch.int32,
                                      device=device)
        self.q = torch.randn(bs, heads, head_dim, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5
        self.groups = [(prefix, list(range(g * members, (g + 1) * members)))
                       for g in range(groups)]
        self.shared = self.shared_for(sp.BLOCK_M)
        # bytes each approach must read: every row's KV, or each prefix once plus the suffixes
        per_token = 2 * kv_heads * head_dim * self.k.element_size()
        self.kv_bytes_plain = sum(self.lens) * per_token
        self.kv_bytes = (groups * prefix + bs * suffix) * per_token

    def shared_for(self, rows: int) -> Any:
        """The groups' work items (int32, as the runtime hands them) in tiles of `rows` query
        rows: `SharedPrefixes`."""
        from lmnb.runtime.kernels import shared_prefix as sp

        members = sp.members_per_tile(self.heads, self.kv_heads, rows)
        plan = sp.plan_items(self.groups, batch_size=len(self.lens), members=members,
                             max_items=sp.GRAPH_ITEMS)
        flat = torch.tensor(plan.flat(sp.GRAPH_ITEMS, members), dtype=torch.int32,
                            device=self.q.device)
        return sp.SharedPrefixes.view(flat, batch_size=len(self.lens), num_items=sp.GRAPH_ITEMS,
                                      members=members)


def shared_runs(batch: SharedBatch, sweep: bool, parts: str = "prefix,suffix",
                prefix_rows: tuple[int, ...] = ()) -> list[tuple[str, Callable[[], Any], dict]]:
    """The plain kernel, the shared default, and with `sweep` a grid of the prefix kernel's
    tiles and of the suffix kernel's configs (`parts`: which of the two grids). Each height
    of `prefix_rows` (query rows a prefix tile stacks, a key of `PREFIX_TILES`) adds its
    default tile and, with the prefix sweep, its grid."""
    from lmnb.runtime.kernels import shared_prefix as sp
    from lmnb.runtime.kernels import triton_decode as td

    out = torch.empty_like(batch.q)
    bs, splits = len(batch.lens), 16
    part_o, part_lse = td.partial_buffers(bs, batch.heads, batch.head_dim,
                                          splits + sp.PREFIX_SPLITS, batch.q.device)
    default = td.decode_config(batch.head_dim, batch.dtype, batch_size=bs,
                               num_kv_heads=batch.kv_heads, shared=True)
    busy = td.decode_config(batch.head_dim, batch.dtype, batch_size=bs,
                            num_kv_heads=batch.kv_heads)

    def launcher(config: td.DecodeConfig, shared: Any, prefix: sp.PrefixTile | None = None
                 ) -> Callable[[], Any]:
        rows = (None if shared is None else
                sp.tile_height(shared.items.shape[1] - sp.ITEM_HEAD, batch.heads, batch.kv_heads))

        def run() -> torch.Tensor:
            saved = dict(sp.PREFIX_TILES)
            if prefix is not None:
                sp.PREFIX_TILES[rows] = prefix
            try:
                return td.decode_attention(batch.q, batch.k, batch.v, out, batch.kv_indptr,
                                           batch.kv_indices, part_o, part_lse,
                                           scale=batch.scale, max_kv_splits=splits,
                                           config=config, shared=shared)
            finally:
                sp.PREFIX_TILES.update(saved)
        return run

    runs = [("plain (no sharing)", launcher(busy, None), {}),
            ("shared default", launcher(default, batch.shared), {}),
            ("shared, a 16-split suffix grid", launcher(default._replace(max_splits=16),
                                                        batch.shared), {}),
            ("shared, suffixes with the batch's own tile", launcher(busy, batch.shared), {})]
    heights = {sp.BLOCK_M: batch.shared} | {rows: batch.shared_for(rows) for rows in prefix_rows
                                            if rows != sp.BLOCK_M}
    for rows, shared in heights.items():
        if rows != sp.BLOCK_M:
            runs.append((f"shared, {rows}-row prefix tiles", launcher(default, shared),
                         {"prefix_rows": rows}))
        if sweep and "prefix" in parts:
            for block_n, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8),
                                                            (1, 2, 3)):
                runs.append((f"shared prefix {rows} rows n{block_n} w{warps} s{stages}",
                             launcher(default, shared, sp.PrefixTile(block_n, warps, stages)),
                             {"prefix_rows": rows, "prefix": [block_n, warps, stages]}))
    if sweep and "suffix" in parts:
        for block_n, warps, stages, min_split in itertools.product(
                (32, 64, 128), (1, 2, 4), (1, 2), (64, default.min_split)):
            config = td.DecodeConfig(block_n, min_split, warps, stages)
            runs.append((f"shared suffix {block_n} w{warps} s{stages} m{min_split}",
                         launcher(config, batch.shared), config._asdict()))
    return runs


class Paged(NamedTuple):
    """A batch's KV in whole `page`-token pages (random contents, pages in shuffled order)."""

    pages_per: list[int]  # pages of each request
    k: torch.Tensor  # [pages, page, kv_heads, head_dim]
    v: torch.Tensor
    order: torch.Tensor  # [pages] int32: the page ids, request by request


def paged(batch: Batch, page: int) -> Paged:
    pages_per = [(n + page - 1) // page for n in batch.lens]
    npages = sum(pages_per)
    k = torch.randn(npages, page, batch.kv_heads, batch.head_dim, dtype=batch.dtype,
                    device=batch.q.device)
    order = torch.randperm(npages, device=batch.q.device).to(torch.int32)
    return Paged(pages_per, k, torch.randn_like(k), order)


def flashinfer_runs(batch: Batch) -> list[tuple[str, Callable[[], Any], dict]]:
    try:
        import flashinfer
    except ImportError:
        return []
    runs = []
    device = batch.q.device
    # page size 1 over the pool as it is (lmnb's FlashInfer backend)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD")
    wrapper.plan(batch.kv_indptr, batch.kv_indices,
                 torch.ones(len(batch.lens), dtype=torch.int32, device=device), batch.heads,
                 batch.kv_heads, batch.head_dim, 1, q_data_type=batch.dtype,
                 kv_data_type=batch.dtype, sm_scale=batch.scale)
    cache = (batch.k.unsqueeze(1), batch.v.unsqueeze(1))
    runs.append(("flashinfer page 1", lambda: wrapper.run(batch.q, cache), {}))
    # page size 16 (a copy of the KV into whole pages)
    page = 16
    pages = paged(batch, page)
    indptr16 = torch.tensor([0, *itertools.accumulate(pages.pages_per)], dtype=torch.int32,
                            device=device)
    last = torch.tensor([n - (p - 1) * page
                         for n, p in zip(batch.lens, pages.pages_per, strict=True)],
                        dtype=torch.int32, device=device)
    wrapper16 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD")
    wrapper16.plan(indptr16, pages.order, last, batch.heads, batch.kv_heads, batch.head_dim, page,
                   q_data_type=batch.dtype, kv_data_type=batch.dtype, sm_scale=batch.scale)
    runs.append(("flashinfer page 16", lambda: wrapper16.run(batch.q, (pages.k, pages.v)), {}))
    return runs


def fixed_scale_runs(batch: Batch, with_flashinfer: bool
                     ) -> list[tuple[str, Callable[[], Any], dict]]:
    """An FP8 batch's K/V requantized with one scale per tensor (amax / 448), read by Triton's
    default config and, `with_flashinfer` and installed, FlashInfer's paged decode."""
    from lmnb.runtime.kernels import triton_decode as td
    from lmnb.runtime.memory.kv_storage import FP8_MAX, fixed_scale_view, quantize_fixed

    device = batch.q.device
    every = torch.arange(batch.k.shape[0], device=device)
    pools, scales = [], []
    for name in ("k", "v"):
        values = batch.kv_float(name, every)
        scale = max(float(values.abs().max()) / FP8_MAX, 1e-12)
        pools.append(quantize_fixed(values, scale))
        scales.append(scale)
        del values
    k, v = pools
    kv_bytes = 2 * sum(batch.lens) * batch.kv_heads * batch.head_dim
    fixed = tuple(fixed_scale_view(scale, k.shape[0], batch.kv_heads, device)
                  for scale in scales)
    out = torch.empty_like(batch.q)
    default = td.decode_config(batch.head_dim, k.dtype, batch_size=len(batch.lens),
                               num_kv_heads=batch.kv_heads, sm_count=td.multiprocessors(device))
    part_o, part_lse = td.partial_buffers(len(batch.lens), batch.heads, batch.head_dim, 16,
                                          device)
    runs = [("triton default, fixed scales", lambda: td.decode_attention(
        batch.q, k, v, out, batch.kv_indptr, batch.kv_indices, part_o, part_lse,
        scale=batch.scale, max_kv_splits=16, config=default, kv_scales=fixed),
        {**default._asdict(), "kv_bytes": kv_bytes})]
    if not with_flashinfer:
        return runs
    try:
        import flashinfer
    except ImportError:
        return runs
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD",
        use_tensor_cores=batch.heads // batch.kv_heads >= 4)  # as lmnb's backend
    wrapper.plan(batch.kv_indptr, batch.kv_indices,
                 torch.ones(len(batch.lens), dtype=torch.int32, device=device), batch.heads,
                 batch.kv_heads, batch.head_dim, 1, q_data_type=batch.dtype,
                 kv_data_type=k.dtype, sm_scale=batch.scale)
    cache = (k.unsqueeze(1), v.unsqueeze(1))
    runs.append(("flashinfer page 1, fixed scales",
                 lambda: wrapper.run(batch.q, cache, k_scale=scales[0], v_scale=scales[1]),
                 {"kv_bytes": kv_bytes}))
    return runs


def fa3_runs(batch: Batch) -> list[tuple[str, Callable[[], Any], dict]]:
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - vLLM is an optional peer here
        return []
    device = batch.q.device
    pages = paged(batch, 16)
    table = torch.zeros(len(batch.lens), max(pages.pages_per), dtype=torch.int32, device=device)
    cursor = 0
    for i, p in enumerate(pages.pages_per):
        table[i, :p] = pages.order[cursor:cursor + p]
        cursor += p
    seqused = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    cu_q = torch.arange(len(batch.lens) + 1, dtype=torch.int32, device=device)
    runs = []
    for version in (3, 2):
        def run(version: int = version) -> torch.Tensor:
            return flash_attn_varlen_func(
                q=batch.q, k=pages.k, v=pages.v, max_seqlen_q=1, cu_seqlens_q=cu_q,
                max_seqlen_k=max(batch.lens), seqused_k=seqused, block_table=table,
                softmax_scale=batch.scale, causal=True, fa_version=version)
        try:
            run()
        except Exception as error:  # noqa: BLE001
            print(f"vLLM FA{version}: {error}")
            continue
        runs.append((f"vllm fa{version} page 16", run, {}))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--scatter", action="store_true")
    parser.add_argument("--decoded", type=int, default=0,
                        help="the last N tokens of each request laid out by decode steps")
    parser.add_argument("--pool-slots", type=int, default=0, help="KV pool size in tokens")
    parser.add_argument("--sweep", action="store_true", help="time a grid of Triton configs")
    parser.add_argument("--kv-fp8", action="store_true",
                        help="an FP8 pool (e4m3 K/V + per-(slot, head) float32 scales)")
    parser.add_argument("--slot-major-scales", action="store_true",
                        help="with --kv-fp8: scales [slots, kv_heads] contiguous (the old layout)")
    parser.add_argument("--shared", default=None, metavar="GROUPS:MEMBERS:PREFIX:SUFFIX",
                        help="a shared-prefix decode step instead (e.g. 64:4:600:64 fork-heavy, "
                             "8:32:1500:48 few-shot): plain vs shared-prefix kernels")
    parser.add_argument("--prefix-rows", default="",
                        help="with --shared: comma list of prefix tile heights (query rows: "
                             "members x padded GQA group; 16, 32, 64) timed besides the default")
    parser.add_argument("--max-kv-splits", default="16",
                        help="comma list: the split grid dimension(s) of the Triton launches")
    parser.add_argument("--split-grids", default="", metavar="S:M,...",
                        help="split grids to time besides the default (max_splits:min_split, "
                             "the default's tile)")
    parser.add_argument("--shared-sweep", default="prefix,suffix",
                        help="with --shared --sweep: the grids to time (prefix, suffix or both)")
    parser.add_argument("--tiles", default="", metavar="N:W:S,...",
                        help="Triton tiles to time besides the default (block_n:warps:stages, "
                        "the default's loop variant and splits), without the whole --sweep")
    parser.add_argument("--heads-first", action="store_true",
                        help="also time each config with the (KV head, request) grid order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", default="flashinfer,fa3",
                        help="comma list of the other kernels timed beside Triton's (flashinfer: "
                        "JIT-compiles two decode modules on a fresh machine, minutes; fa3: "
                        "vLLM's, when importable); '' for Triton alone")
    parser.add_argument("--json", default=None,
                        help="default bench/results/decode_kernel.json (_fp8 with --kv-fp8)")
    args = parser.parse_args()
    peers = {name for name in args.peers.split(",") if name}
    unknown = sorted(peers - {"flashinfer", "fa3"})
    if unknown:
        parser.error(f"unknown peers {unknown}; known: flashinfer, fa3")
    device = torch.device(args.device)
    heads, kv_heads, head_dim, dtype = MODELS[args.model]
    if args.shared:
        groups, members, prefix, suffix = map(int, args.shared.split(":"))
        shared = SharedBatch(groups=groups, members=members, prefix=prefix, suffix=suffix,
                             heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                             device=device)
        rows = []
        heights = tuple(int(rows) for rows in args.prefix_rows.split(",") if rows)
        for name, run, _config in shared_runs(shared, args.sweep, args.shared_sweep, heights):
            try:
                ms = time_kernel(run)
            except Exception as failure:  # noqa: BLE001
                print(f"{name}: {type(failure).__name__}: {failure}")
                continue
            rows.append([name, f"{ms * 1000:.1f}", f"{shared.kv_bytes / ms / 1e6:.0f}",
                         f"{shared.kv_bytes_plain / ms / 1e6:.0f}"])
        rows.sort(key=lambda r: float(r[1]))
        print(f"{args.model} shared {args.shared}: KV {shared.kv_bytes / 1e6:.0f} MB per layer "
              f"read once per group, {shared.kv_bytes_plain / 1e6:.0f} MB per request")
        print(format_table(["kernels", "us", "GB/s (shared)", "GB/s (plain-equivalent)"],
                           rows[:30]))
        return
    rng = random.Random(args.seed)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.batch)]
    batch = Batch(lens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  scatter=args.scatter, device=device, seed=args.seed, decoded=args.decoded,
                  pool_slots=args.pool_slots, kv_fp8=args.kv_fp8,
                  slot_major_scales=args.slot_major_scales)
    reference = batch.reference()
    rows = []
    results = []
    split_counts = tuple(int(n) for n in args.max_kv_splits.split(","))
    split_grids = tuple(tuple(int(v) for v in grid.split(":"))
                        for grid in args.split_grids.split(",") if grid)
    tiles = tuple(tuple(int(v) for v in tile.split(":")) for tile in args.tiles.split(",") if tile)
    others = []
    if not args.kv_fp8:  # the peers read 16-bit KV only
        others += flashinfer_runs(batch) if "flashinfer" in peers else []
        others += fa3_runs(batch) if "fa3" in peers else []
    else:
        others += fixed_scale_runs(batch, "flashinfer" in peers)
    runs = triton_runs(batch, args.sweep, split_counts, tiles, split_grids,
                       args.heads_first) + others
    for name, run, config in runs:
        try:
            got = run()
            error = (None if got is None else
                     float((got[:len(reference)].float() - reference).abs().max()))
            ms = time_kernel(run)
        except Exception as failure:  # noqa: BLE001 - a config that does not compile is a row
            print(f"{name}: {type(failure).__name__}: {failure}")
            continue
        gbps = config.get("kv_bytes", batch.kv_bytes) / ms / 1e6
        rows.append([name, f"{ms * 1000:.1f}", f"{gbps:.0f}", f"{error:.1e}" if error else "-"])
        results.append({"name": name, "us": ms * 1000, "kv_gb_per_s": gbps,
                        "max_abs_error": error, "config": config})
    rows.sort(key=lambda r: float(r[1]))
    pool = "FP8 KV (+ scales)" if args.kv_fp8 else "KV"
    print(f"{args.model} batch {args.batch}, lens {args.min_len}-{args.max_len} "
          f"(mean {sum(lens) / len(lens):.0f}), {pool} {batch.kv_bytes / 1e6:.0f} MB per layer")
    print(format_table(["kernel", "us", "KV GB/s", "max err"], rows[:40]))
    json_path = args.json or ("bench/results/decode_kernel_fp8.json" if args.kv_fp8
                              else "bench/results/decode_kernel.json")
    write_json(Path(json_path), {"args": vars(args), "environment": environment(device),
                                 "kv_bytes": batch.kv_bytes, "results": results})


if __name__ == "__main__":
    main()
