"""The W8A8 FP8 GEMM for 2-128 rows (`mm_fp8.w8a8_mm`, Triton) against `torch._scaled_mm`
(cuBLASLt), at Llama-3-8B's four linears.

At M rows of a large decode batch or a short prefill: microseconds per call (CUDA graph of CALLS
calls over rotating weight copies larger than L2, so each call reads its weight from HBM as a
forward does; best of 3), the weight's bytes over that time, and whether the Triton output is
within bf16 rounding of `_scaled_mm`'s. At <= 16 rows also the 16-bit-activation GEMMs over the
same weights: the skinny W8A16 kernel (batch-1 decode's) and `mm_fp8.w8a16_mm` on the W8A8 rule's
split-K tiles (each within bf16 rounding of x @ the dequantized weight). With --sweep, a grid of
Triton tiles per shape, its best reported beside `w8a8_config`'s pick. JSON to
bench/results/w8a8_mm.json (and $OUT/w8a8_mm.json when $OUT is set).
    python bench/w8a8_mm.py [--rows 64,128,234,256,512] [--sweep]   # on the GPU machine
    python bench/w8a8_mm.py --tiny                                  # CPU: the interpreter
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if "--tiny" in sys.argv:  # before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    graph_seconds_per_call,
    write_results,
)
from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv  # noqa: E402
from lmnb.runtime.kernels.fused.mm_fp8 import (  # noqa: E402
    W8A16Config,
    w8a8_config,
    w8a8_mm,
    w8a16_mm,
)
from lmnb.runtime.kernels.multiprocessors import multiprocessors  # noqa: E402
from lmnb.runtime.models.layers import fp8  # noqa: E402

CALLS = 24
L2_BYTES = 64 << 20  # at least H100's 50 MB and H200's 50 MB
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K) of Llama-3-8B's linears
SWEEP = [W8A16Config(bm, bn, bk, 8, warps, stages) for bm, bn, bk, warps, stages in (
    (16, 64, 128, 4, 5), (16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 5),
    (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 128, 4, 5),
    (64, 64, 256, 4, 3), (64, 128, 64, 4, 5), (64, 128, 128, 4, 3), (64, 128, 128, 4, 4),
    (64, 256, 128, 8, 3), (128, 64, 128, 4, 4), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4),
    (128, 256, 64, 8, 3))]

# at decode's 2-16 rows: 16-row tiles, K split until the SMs hold ~2-16 programs each
SMALL_ROWS = 16
SMALL_SWEEP_TILES = [(16, bn, bk, 4, stages) for bn, bk, stages in itertools.product(
    (32, 64, 128), (128, 256), (4, 6))]


def small_rows_sweep(n: int, k: int, multiprocessors: int) -> list[W8A16Config]:
    configs = []
    for bm, bn, bk, warps, stages in SMALL_SWEEP_TILES:
        tiles = -(-n // bn)
        for split in (1, 2, 4, 8):
            if (split == 1 or tiles * split <= 16 * multiprocessors) and k // split >= 2 * bk:
                configs.append(W8A16Config(bm, bn, bk, 8, warps, stages, split))
                if bn >= 64:  # the weight's rows on wgmma's 64-row side
                    configs.append(W8A16Config(bm, bn, bk, 8, warps, stages, split, True))
    return configs


def _scaled_mm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1),
                            out_dtype=torch.bfloat16)


def _close(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Within bf16 rounding (2^-7) of each row's largest value."""
    mine, theirs = mine.float(), theirs.float()
    return bool(((mine - theirs).abs() <= 2**-7 * theirs.abs().amax(1, keepdim=True)).all())


def run_shape(op: str, m: int, n: int, k: int, device: str, sweep: bool, replays: int
              ) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(m + n)
    codes, scale = fp8.quantize_tokens(torch.randn(m, k, device=device, generator=gen))
    copies = max(1, -(-2 * L2_BYTES // (n * k))) if device == "cuda" else 1
    weights = [fp8.quantize_rows(torch.randn(n, k, device=device, generator=gen))
               for _ in range(copies)]
    reference = (codes.float() @ weights[0][0].float().t()) * scale * weights[0][1][None, :]
    sms = multiprocessors(torch.device(device)) or 132
    configs = [("triton default", w8a8_config(m, n, k, sms))]
    if sweep:
        grid = small_rows_sweep(n, k, sms) if m <= SMALL_ROWS else SWEEP
        configs += [(f"triton {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} "
                     f"s{c.num_stages} k{c.split_k}{' swap' if c.swap_ab else ''}", c)
                    for c in grid]
    rows = []
    if device == "cuda":
        theirs = _scaled_mm(codes, scale, *weights[0])
        us = graph_seconds_per_call(
            lambda i: _scaled_mm(codes, scale, *weights[i % copies]), calls=CALLS,
            replays=replays) * 1e6
        rows.append({"op": op, "m": m, "kernel": "_scaled_mm", "us": us, "close": True})
        if m <= fp8.SKINNY_MAX_ROWS:  # what decode at these rows takes: 16-bit x, no quantize
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            exact = x.float() @ fp8.dequantize_rows(*weights[0]).t()
            us = graph_seconds_per_call(
                lambda i: fp8_gemv(x, *weights[i % copies]), calls=CALLS,
                replays=replays) * 1e6
            rows.append({"op": op, "m": m, "kernel": "skinny W8A16", "us": us,
                         "close": _close(fp8_gemv(x, *weights[0]), exact)})
            # the same 16-bit x through the W8A16 GEMM on the W8A8 rule's split-K tiles (no
            # per-token quantization in front; the FP8 weight converted in registers)
            split = w8a8_config(m, n, k, sms)._replace(swap_ab=False)
            us = graph_seconds_per_call(
                lambda i: w8a16_mm(x, *weights[i % copies], None, split), calls=CALLS,
                replays=replays) * 1e6
            rows.append({"op": op, "m": m, "kernel": "W8A16 split-K", "us": us,
                         "close": _close(w8a16_mm(x, *weights[0], None, split), exact),
                         "config": split._asdict()})
    else:
        theirs = reference
    for name, config in configs:
        mine = w8a8_mm(codes, scale, *weights[0], None, torch.bfloat16, config)
        us = None
        if device == "cuda":
            us = graph_seconds_per_call(
                lambda i, c=config: w8a8_mm(codes, scale, *weights[i % copies], None,
                                            torch.bfloat16, c),
                calls=CALLS, replays=replays) * 1e6
        rows.append({"op": op, "m": m, "kernel": name, "us": us, "close": _close(mine, theirs),
                     "config": config._asdict()})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,128,234,256,512", help="M values, comma-separated")
    parser.add_argument("--ops", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, Triton's interpreter: M 37, N 40, K 96; closeness only")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shapes = ({"tiny": (40, 96)} if args.tiny else
              {op: SHAPES[op] for op in args.ops.split(",")})
    ms = [37] if args.tiny else [int(r) for r in args.rows.split(",")]
    results, table = [], []
    for op, (n, k) in shapes.items():
        for m in ms:
            rows = run_shape(op, m, n, k, device, args.sweep and not args.tiny, args.replays)
            results += rows
            base = rows[0]["us"] if rows[0]["kernel"] == "_scaled_mm" else None
            timed = [r for r in rows if r["us"] is not None and r["kernel"].startswith("triton")]
            best = min(timed, key=lambda r: r["us"]) if timed else None
            for r in rows:
                if r["kernel"] in ("_scaled_mm", "skinny W8A16", "W8A16 split-K",
                                   "triton default") or r is best:
                    gbs = n * k / (r["us"] * 1e3) if r["us"] else None
                    table.append([op, m, r["kernel"] + (" (best)" if r is best else ""),
                                  r["us"], gbs, base / r["us"] if base and r["us"] else None,
                                  r["close"]])
    print(format_table(["op", "M", "kernel", "us/call", "weight GB/s", "x _scaled_mm",
                        "close"], table))
    write_results(RESULTS_DIR / ("w8a8_mm_tiny.json" if args.tiny else "w8a8_mm.json"),
                  {"environment": environment(device), "results": results})
    return 0 if all(r["close"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
