"""Decode attention alone at the offline workload's shapes: lmnb's Triton split-K kernel over a
sweep of launch configurations, FlashInfer's paged decode (page size 1, as lmnb's FlashInfer
backend calls it, and 16) and, when vLLM's wheel is importable, its FlashAttention-3 over a block
table of 16-token pages, each as achieved KV bandwidth (bytes of K and V read / kernel time).

    python bench/decode_kernel.py --device cuda --model llama3 --batch 256
    python bench/decode_kernel.py --device cuda --model llama2 --sweep

The batch's context lengths are drawn uniformly from [--min-len, --max-len] (seeded); each
request's KV slots are one contiguous run of the pool, the runs in shuffled order (a pool some
time into a run), or every slot scattered with `--scatter`.
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, format_table, write_json

MODELS = {  # (query heads, KV heads, head_dim, dtype)
    "llama3": (32, 8, 128, torch.bfloat16),
    "llama2": (32, 32, 128, torch.float16),
}


class Batch:
    def __init__(self, *, lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scatter: bool, device: torch.device, seed: int) -> None:
        rng = random.Random(seed)
        self.lens = lens
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        total = sum(lens)
        slots = total + 16 * len(lens) + 16
        self.k = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
        order = list(range(len(lens)))
        rng.shuffle(order)
        starts = [0] * len(lens)
        cursor = 1  # slot 0 is the padding slot
        for i in order:
            starts[i] = cursor
            cursor += lens[i]
        indices = torch.cat([torch.arange(starts[i], starts[i] + n) for i, n in enumerate(lens)])
        if scatter:
            perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)) + 1
            indices = perm
        self.kv_indices = indices.to(device=device, dtype=torch.int32)
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                                      device=device)
        self.q = torch.randn(len(lens), heads, head_dim, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * total * kv_heads * head_dim * self.k.element_size()

    def reference(self, rows: int = 4) -> torch.Tensor:
        """Attention of the first `rows` requests in float32."""
        outs = []
        group = self.heads // self.kv_heads
        for i in range(rows):
            idx = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]].long()
            k = self.k[idx].float().repeat_interleave(group, 1)  # [n, heads, d]
            v = self.v[idx].float().repeat_interleave(group, 1)
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


def triton_runs(batch: Batch, sweep: bool) -> list[tuple[str, Callable[[], Any], dict]]:
    from lmnb.runtime.kernels import triton_decode as td

    out = torch.empty_like(batch.q)
    default = td.decode_config(batch.head_dim, batch.dtype, batch_size=len(batch.lens),
                               num_kv_heads=batch.kv_heads)
    configs = [("default", default)]
    if sweep:
        for block_n, warps, stages, min_split in itertools.product(
                (32, 64, 128), (2, 4, 8), (1, 2, 3), (default.min_split, 4096)):
            configs.append((f"n{block_n} w{warps} s{stages} m{min_split}",
                            td.DecodeConfig(block_n, min_split, warps, stages)))
    runs = []
    splits = 16
    for name, config in configs:
        part_o, part_lse = td.partial_buffers(len(batch.lens), batch.heads, batch.head_dim,
                                              splits, batch.q.device)

        def run(config: td.DecodeConfig = config, part_o: torch.Tensor = part_o,
                part_lse: torch.Tensor = part_lse) -> torch.Tensor:
            return td.decode_attention(batch.q, batch.k, batch.v, out, batch.kv_indptr,
                                       batch.kv_indices, part_o, part_lse, scale=batch.scale,
                                       max_kv_splits=splits, config=config)
        runs.append((f"triton {name}", run, config._asdict()))
    return runs


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
    pages_per = [(n + page - 1) // page for n in batch.lens]
    npages = sum(pages_per)
    k16 = torch.randn(npages, page, batch.kv_heads, batch.head_dim, dtype=batch.dtype,
                      device=device)
    v16 = torch.randn_like(k16)
    perm = torch.randperm(npages, device=device).to(torch.int32)
    indptr16 = torch.tensor([0, *itertools.accumulate(pages_per)], dtype=torch.int32,
                            device=device)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(batch.lens, pages_per, strict=True)],
                        dtype=torch.int32, device=device)
    wrapper16 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD")
    wrapper16.plan(indptr16, perm, last, batch.heads, batch.kv_heads, batch.head_dim, page,
                   q_data_type=batch.dtype, kv_data_type=batch.dtype, sm_scale=batch.scale)
    runs.append(("flashinfer page 16", lambda: wrapper16.run(batch.q, (k16, v16)), {}))
    return runs


def fa3_runs(batch: Batch) -> list[tuple[str, Callable[[], Any], dict]]:
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - vLLM is an optional peer here
        return []
    device = batch.q.device
    page = 16
    pages_per = [(n + page - 1) // page for n in batch.lens]
    npages = sum(pages_per)
    k16 = torch.randn(npages, page, batch.kv_heads, batch.head_dim, dtype=batch.dtype,
                      device=device)
    v16 = torch.randn_like(k16)
    perm = torch.randperm(npages, device=device).to(torch.int32)
    width = max(pages_per)
    table = torch.zeros(len(batch.lens), width, dtype=torch.int32, device=device)
    cursor = 0
    for i, p in enumerate(pages_per):
        table[i, :p] = perm[cursor:cursor + p]
        cursor += p
    seqused = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    cu_q = torch.arange(len(batch.lens) + 1, dtype=torch.int32, device=device)
    runs = []
    for version in (3, 2):
        def run(version: int = version) -> torch.Tensor:
            return flash_attn_varlen_func(
                q=batch.q, k=k16, v=v16, max_seqlen_q=1, cu_seqlens_q=cu_q,
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
    parser.add_argument("--sweep", action="store_true", help="time a grid of Triton configs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/decode_kernel.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    heads, kv_heads, head_dim, dtype = MODELS[args.model]
    rng = random.Random(args.seed)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.batch)]
    batch = Batch(lens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  scatter=args.scatter, device=device, seed=args.seed)
    reference = batch.reference()
    rows = []
    results = []
    for name, run, config in (triton_runs(batch, args.sweep) + flashinfer_runs(batch)
                              + fa3_runs(batch)):
        try:
            got = run()
            error = float((got[:4].float() - reference).abs().max()) if got is not None else None
            ms = time_kernel(run)
        except Exception as failure:  # noqa: BLE001 - a config that does not compile is a row
            print(f"{name}: {type(failure).__name__}: {failure}")
            continue
        gbps = batch.kv_bytes / ms / 1e6
        rows.append([name, f"{ms * 1000:.1f}", f"{gbps:.0f}", f"{error:.1e}" if error else "-"])
        results.append({"name": name, "us": ms * 1000, "kv_gb_per_s": gbps,
                        "max_abs_error": error, "config": config})
    rows.sort(key=lambda r: float(r[1]))
    print(f"{args.model} batch {args.batch}, lens {args.min_len}-{args.max_len} "
          f"(mean {sum(lens) / len(lens):.0f}), KV {batch.kv_bytes / 1e6:.0f} MB per layer")
    print(format_table(["kernel", "us", "KV GB/s", "max err"], rows[:40]))
    write_json(Path(args.json), {"args": vars(args), "environment": environment(device),
                                 "kv_bytes": batch.kv_bytes, "results": results})


if __name__ == "__main__":
    main()
