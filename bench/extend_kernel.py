"""Extend (prefill) attention alone at the vs-vLLM workloads' shapes: lmnb's Triton extend kernel
over a sweep of tile configurations and, when vLLM's wheel is importable, its FlashAttention-3
over a block table of 16-token pages, each as achieved TFLOP/s (causal FLOPs actually needed /
kernel time) for one layer of Llama-3-8B (32 heads, 8 KV heads, head size 128, bf16).

Shapes (`--shapes`):
  offline   a prefill chunk of the offline workload: 14 prompts of 100-1,024 new tokens, no prefix
  prefix    the shared-prefix workload: 256 requests of 40 new tokens after a cached 1,500-token
            prefix (8 groups of 32 sharing one)
  fork      the fork workload's questions: 256 requests of 32 new tokens after a cached
            600-token document (64 groups of 4)
  first     the shared-prefix run's first pass: 5 whole 1,540-token prompts and the first 492
            tokens of a sixth (8,192 new tokens, no prefix)
  mixed     a later pass of that run: the sixth prompt's other 1,048 tokens, two more whole
            prompts, and 100 questions of 40 tokens after the five cached 1,500-token prefixes

    python bench/extend_kernel.py --device cuda
    python bench/extend_kernel.py --device cuda --sweep --shapes prefix
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, format_table, write_json  # noqa: E402
from bench.decode_kernel import time_kernel  # noqa: E402

MODELS = {  # (query heads, KV heads, head_dim, dtype)
    "llama3": (32, 8, 128, torch.bfloat16),
    "llama2": (32, 32, 128, torch.float16),
}


class Extend:
    """A ragged extend batch: request i has prefix_lens[i] cached tokens (shared within a group:
    the same slots) and new_lens[i] new ones, all in one KV pool."""

    def __init__(self, *, groups: list[tuple[int, list[int]]], device: torch.device,
                 seed: int, model: str = "llama3") -> None:
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.dtype = MODELS[model]
        self.prefix_lens = [prefix for prefix, members in groups for _ in members]
        self.new_lens = [n for _, members in groups for n in members]
        slots = sum(prefix for prefix, _ in groups) + sum(self.new_lens) + 1
        kv_shape = (slots, self.kv_heads, self.head_dim)
        self.k = torch.randn(kv_shape, dtype=self.dtype, device=device)
        self.v = torch.randn(kv_shape, dtype=self.dtype, device=device)
        rows, cursor = [], 1
        for prefix, members in groups:
            shared = list(range(cursor, cursor + prefix))
            cursor += prefix
            for n in members:
                rows.append(shared + list(range(cursor, cursor + n)))
                cursor += n
        self.rows = rows
        self.kv_indices = torch.tensor([s for row in rows for s in row], dtype=torch.int32,
                                       device=device)
        seq = [p + n for p, n in zip(self.prefix_lens, self.new_lens, strict=True)]
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(seq)], dtype=torch.int32,
                                      device=device)
        self.qo_indptr = torch.tensor([0, *itertools.accumulate(self.new_lens)],
                                      dtype=torch.int32, device=device)
        self.q = torch.randn(sum(self.new_lens), self.heads, self.head_dim, dtype=self.dtype,
                             device=device)
        self.scale = self.head_dim ** -0.5
        # causal FLOPs: each new token t of a request sees prefix + t + 1 keys; 4 flops a
        # (query head, key, dim): q.k and p.v, a multiply and an add each
        self.flops = sum(4 * self.heads * self.head_dim * (p * n + n * (n + 1) // 2)
                         for p, n in zip(self.prefix_lens, self.new_lens, strict=True))

    def reference(self, request: int) -> torch.Tensor:
        idx = torch.tensor(self.rows[request], device=self.q.device).long()
        group = self.heads // self.kv_heads
        k = self.k[idx].float().repeat_interleave(group, 1)
        v = self.v[idx].float().repeat_interleave(group, 1)
        start, n, p = (int(self.qo_indptr[request]), self.new_lens[request],
                       self.prefix_lens[request])
        q = self.q[start:start + n].float()
        scores = torch.einsum("thd,khd->htk", q, k) * self.scale
        visible = torch.arange(p + n, device=q.device)[None, :] <= (
            p + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


def shape(name: str, device: torch.device, seed: int, model: str = "llama3") -> Extend:
    rng = random.Random(seed)
    if name == "offline":
        lens, total = [], 0
        while total < 8192:
            n = min(rng.randint(100, 1024), 8192 - total)
            lens.append(n)
            total += n
        groups = [(0, [n]) for n in lens]
    elif name == "prefix":
        groups = [(1500, [40] * 32) for _ in range(8)]
    elif name == "fork":
        groups = [(600, [32] * 4) for _ in range(64)]
    elif name == "first":
        groups = [(0, [1540]) for _ in range(5)] + [(0, [492])]
    elif name == "mixed":
        groups = ([(492, [1048]), (0, [1540]), (0, [1540])]
                  + [(1500, [40] * 20) for _ in range(5)])
    else:
        raise ValueError(name)
    return Extend(groups=groups, device=device, seed=seed, model=model)


def triton_runs(batch: Extend, sweep: bool,
                tiles: tuple[tuple[int, ...], ...] = ()
                ) -> list[tuple[str, Callable[[], Any], dict]]:
    """The default config, the sweep's grid with `sweep`, and each (block_m, block_n, warps,
    stages[, k_rows]) of `tiles`."""
    from lmnb.runtime.kernels import triton_extend as te

    out = torch.empty_like(batch.q)
    group = batch.heads // batch.kv_heads
    configs = [("default", te.extend_config(batch.head_dim, batch.dtype,
                                            rows=[n * group for n in batch.new_lens],
                                            group=group))]
    for block_m, block_n, warps, stages, *k_rows in tiles:
        configs.append((f"m{block_m} n{block_n} w{warps} s{stages}{' k_rows' * any(k_rows)}",
                        te.ExtendConfig(block_m, block_n, warps, stages, any(k_rows))))
    if sweep:
        for block_m, block_n, warps, stages, k_rows in itertools.product(
                (64, 128), (32, 64, 128), (4, 8), (2, 3), (False, True)):
            if block_n == 128 and (block_m == 64 or warps == 4):
                continue
            configs.append((f"m{block_m} n{block_n} w{warps} s{stages}{' k_rows' * k_rows}",
                            te.ExtendConfig(block_m, block_n, warps, stages, k_rows)))
    runs = []
    for name, config in configs:
        def run(config: te.ExtendConfig = config) -> torch.Tensor:
            return te.extend_attention(batch.q, batch.k, batch.v, out, batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices,
                                       max_extend_len=max(batch.new_lens), scale=batch.scale,
                                       config=config)
        runs.append((f"triton {name}", run, config._asdict()))
    return runs


def fa3_runs(batch: Extend) -> list[tuple[str, Callable[[], Any], dict]]:
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - vLLM is an optional peer here
        return []
    device = batch.q.device
    page = 16
    seq = [p + n for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True)]
    pages_per = [(s + page - 1) // page for s in seq]
    k = torch.randn(sum(pages_per), page, batch.kv_heads, batch.head_dim, dtype=batch.dtype,
                    device=device)
    v = torch.randn_like(k)
    order = torch.randperm(sum(pages_per), device=device).to(torch.int32)
    table = torch.zeros(len(seq), max(pages_per), dtype=torch.int32, device=device)
    cursor = 0
    for i, p in enumerate(pages_per):
        table[i, :p] = order[cursor:cursor + p]
        cursor += p
    seqused = torch.tensor(seq, dtype=torch.int32, device=device)

    def run() -> torch.Tensor:
        return flash_attn_varlen_func(
            q=batch.q, k=k, v=v, max_seqlen_q=max(batch.new_lens), cu_seqlens_q=batch.qo_indptr,
            max_seqlen_k=max(seq), seqused_k=seqused, block_table=table,
            softmax_scale=batch.scale, causal=True, fa_version=3)
    try:
        run()
    except Exception as error:  # noqa: BLE001
        print(f"vLLM FA3: {error}")
        return []
    return [("vllm fa3 page 16 (no prefix sharing)", run, {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="offline,prefix,fork")
    parser.add_argument("--sweep", action="store_true", help="time a grid of Triton configs")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3")
    parser.add_argument("--tiles", default="", metavar="M:N:W:S[:K],...",
                        help="extra Triton configs (K 1: K loaded token-major)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/extend_kernel.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"args": vars(args), "environment": environment(device), "shapes": {}}
    for name in args.shapes.split(","):
        batch = shape(name, device, args.seed, args.model)
        check = len(batch.new_lens) - 1
        reference = batch.reference(check)
        start, stop = int(batch.qo_indptr[check]), int(batch.qo_indptr[check + 1])
        rows, results = [], []
        tiles = tuple(tuple(int(v) for v in tile.split(":")) for tile in args.tiles.split(",")
                      if tile)
        for label, run, config in triton_runs(batch, args.sweep, tiles) + fa3_runs(batch):
            try:
                got = run()
                error = (float((got[start:stop].float() - reference).abs().max())
                         if label.startswith("triton") else None)
                ms = time_kernel(run)
            except Exception as failure:  # noqa: BLE001 - a config that fails is a row
                print(f"{name} {label}: {type(failure).__name__}: {failure}")
                continue
            tflops = batch.flops / ms / 1e9
            rows.append([label, f"{ms * 1000:.1f}", f"{tflops:.0f}",
                         "-" if error is None else f"{error:.1e}"])
            results.append({"name": label, "us": ms * 1000, "tflops": tflops,
                            "max_abs_error": error, "config": config})
        rows.sort(key=lambda r: float(r[1]))
        print(f"\n{name}: {len(batch.new_lens)} requests, {sum(batch.new_lens)} new tokens, "
              f"prefixes {sorted(set(batch.prefix_lens))}, {batch.flops / 1e9:.1f} GFLOP a layer")
        print(format_table(["kernel", "us", "TFLOP/s", "max err"], rows[:20]))
        report["shapes"][name] = {"flops": batch.flops, "results": results}
    write_json(Path(args.json), report)


if __name__ == "__main__":
    main()
