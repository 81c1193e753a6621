"""Decode-sized linears: torch F.linear (cuBLAS) against the skinny-GEMM Triton kernel (GPU).

For the linear shapes of Llama-2-7B (fp16) and Llama-3-8B (bf16) — qkv, o, gate_up, down and the
LM head — and a few rows M, each op is timed inside a CUDA graph of CALLS back-to-back calls over
different copies of the weight (at least ~256 MB of them, so the 50 MB L2 does not keep a
weight between calls), replayed many times between CUDA events. Reported: us a call, GB/s of
weight read, and % of the device-to-device copy bandwidth measured in the same run (bytes read +
written / time of a 1 GiB copy_). Every kernel result is checked against an fp32 reference; a
wrong one makes the script exit 1.

`--sweep` also times a grid of kernel configs per (shape, M) and records the best beside the
heuristic's pick, to retune `skinny_config` from one run (several hundred compiles: split it with
`--models` / `--rows` if one run would exceed the device's time limit).

`--fp8`: Llama-3-8B's linears with FP8 (e4m3) weights and per-row scales through
`gemv_fp8.fp8_gemv` (its table's / rule's config; with `--sweep` a grid of configs, each checked
against float32 math), beside the bf16 skinny kernel on the same shape: us a call, GB/s of weight
read, % of the copy bandwidth, FP8's speed-up over bf16, the best config per shape as lines to
paste into `gemv_fp8.TUNED`, and a decode step's linears (32 layers + the LM head, which the
model keeps in bf16; its FP8 row shows what an FP8 head would give) in bf16, FP8 as configured
and FP8 at the sweep's best. JSON: bench/results/gemv_fp8[_sweep].json. qkv and gate_up are
timed as the model runs them at decode (`FP8_FUSED`: the RMSNorm + residual add in the GEMM's
prologue, gate_up's SiLU-and-mul and qkv's rotary + KV store in the epilogue; the sweep tunes
those kernels), beside the same work as separate kernels ("apart": rms_norm, the GEMM,
silu_and_mul / rotary_qkv); `--no-fused`: bare GEMMs; `--kv-fp8`: qkv's K/V store to an FP8
pool with per-(token, head) scales (`kv_cache_dtype="fp8_e4m3"`).

    python bench/gemv.py                      # heuristic vs cuBLAS, all shapes, M = 1 2 4 8 16
    python bench/gemv.py --sweep --models llama2-7b
    python bench/gemv.py --fp8 --sweep        # M = 1 and 16, qkv o gate_up down lm_head
    python bench/gemv.py --fp8 --rows 1 2 4 8 16   # the configured kernel at several M
    python bench/gemv.py --fp8 --kv-fp8 --ops qkv --rows 1 16   # qkv over an FP8 KV pool
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    graph_seconds_per_call,
    write_results,
)
from bench.floor import copy_bandwidth  # noqa: E402
from lmnb.runtime.kernels.fused import rms_norm, rotary_qkv, silu_and_mul  # noqa: E402
from lmnb.runtime.kernels.fused.gemv import (  # noqa: E402
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    skinny_config,
    skinny_linear,
)
from lmnb.runtime.kernels.fused.gemv_fp8 import (  # noqa: E402
    FMA_VEC,
    Fp8GemvConfig,
    RmsNormInput,
    RotaryStore,
    fp8_gemv,
    fp8_gemv_config,
    fp8_norm_gemv,
)
from lmnb.runtime.models.layers import fp8  # noqa: E402

# name -> (dtype, layers, {op: (N, K)})
MODELS: dict[str, tuple[torch.dtype, int, dict[str, tuple[int, int]]]] = {
    "llama2-7b": (torch.float16, 32, {"qkv": (12288, 4096), "o": (4096, 4096),
                                      "gate_up": (22016, 4096), "down": (4096, 11008),
                                      "lm_head": (32000, 4096)}),
    "llama3-8b": (torch.bfloat16, 32, {"qkv": (6144, 4096), "o": (4096, 4096),
                                       "gate_up": (28672, 4096), "down": (4096, 14336),
                                       "lm_head": (128256, 4096)}),
}
CALLS = 20  # calls a graph
MIN_BYTES = 256 << 20  # weight copies cycled through by the calls of one graph
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2}  # max error / max |reference|
FP8_MODEL = "llama3-8b"  # its bf16 activations; the LM head stays bf16 in the model
FP8_OPS = ("qkv", "o", "gate_up", "down")
# What the model runs at decode (layers/linear.py `forward_normed`): qkv after input_layernorm
# and gate_up after post_attention_layernorm, the norm (+ residual add) in the GEMM's prologue,
# gate_up's SiLU-and-mul in its epilogue, qkv's rotary in its epilogue (k and v stored in a KV
# pool). op -> (norm, gated, rotary)
FP8_FUSED = {"qkv": (True, False, True), "gate_up": (True, True, False)}
UNFUSED = (False, False, False)
LLAMA3_HEADS = (32, 8, 128)  # q heads, KV heads, head_dim
ROPE_POSITIONS = 8192


def rotary_store(m: int, kv_slots: int = 256, kv_fp8: bool = False) -> RotaryStore:
    """Llama-3-8B's rotary over m tokens at positions near 8192, k/v to a small bf16 pool (or
    FP8 with per-(token, head) scales)."""
    heads, kv_heads, head_dim = LLAMA3_HEADS
    freqs = torch.outer(torch.arange(ROPE_POSITIONS, dtype=torch.float32, device="cuda"),
                        5e5 ** -(torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    emb = torch.cat((freqs, freqs), -1)
    pool = [torch.zeros(kv_slots, kv_heads, head_dim, device="cuda").to(
        torch.float8_e4m3fn if kv_fp8 else torch.bfloat16) for _ in range(2)]
    scales = tuple(torch.ones(kv_slots, kv_heads, device="cuda") for _ in range(2))
    slots = torch.arange(m, device="cuda")
    return RotaryStore(ROPE_POSITIONS - 1 - slots, emb.cos(), emb.sin(), heads, kv_heads,
                       head_dim, pool[0], pool[1], slots, scales if kv_fp8 else None)
SMS = 132  # an H100's


def time_per_call(fn, xs: list[torch.Tensor], weights: list[torch.Tensor], replays: int) -> float:
    """Seconds per call of fn(x, weight) in a CUDA graph of CALLS calls over the weight copies."""
    for i in range(2):  # compile / pick algorithms outside the capture
        fn(xs[i % len(xs)], weights[i % len(weights)])
    return graph_seconds_per_call(lambda i: fn(xs[i % len(xs)], weights[i % len(weights)]),
                                  calls=CALLS, replays=replays)


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    want = x.float() @ weight.float().t()
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def sweep_grid(m: int, n: int, k: int, elem: int) -> list[SkinnyConfig]:
    """Configs worth timing for one shape (the heuristic's pick is added by the caller); kept
    small: every distinct config is a compile (the dot path's are shared by every M)."""
    grid: list[SkinnyConfig] = []
    splits = [s for s in (1, 2) if k // s >= 1024]
    if m <= 4:  # FMA path, small tiles and many programs, pipelined loads
        for block_n, block_k, stages in itertools.product((1, 2, 4), (512, 1024, 2048), (2, 4)):
            if block_n * block_k * m <= 8192:
                grid.append(SkinnyConfig(block_n, block_k, 1, 4, stages, False))
    if m == 1:  # FMA path: tile rows x 8-32 KB of weight
        for (block_n, tile_kb), warps, split in itertools.product(
                [(4, 16), (8, 16), (8, 32), (16, 16), (16, 32)], (4, 8), splits):
            if split == 1 or math.ceil(n / block_n) < 1024:
                grid.append(SkinnyConfig(block_n, tile_kb * 1024 // elem // block_n, split,
                                         warps, 1, False))
    elif m <= 4:  # FMA path over m rows: the [m, BLOCK_N, BLOCK_K] product is in registers
        for block_n in (8, 16):
            grid.append(SkinnyConfig(block_n, 8192 // elem // block_n // m, 1, 4, 1, False))
    for (block_n, block_k), stages, split in itertools.product(
            [(16, 256), (16, 512), (32, 256), (64, 128)], (3, 5), splits):
        if block_n * block_k * elem * stages <= 160 << 10:
            grid.append(SkinnyConfig(block_n, block_k * 2 // elem, split, 4, stages, True))
    return grid


def bench_shape(model: str, op: str, n: int, k: int, m: int, dtype: torch.dtype,
                copy_bw: float, replays: int, sweep: bool) -> dict[str, Any]:
    elem = torch.empty((), dtype=dtype).element_size()
    weight_bytes = n * k * elem
    copies = max(2, min(CALLS, math.ceil(MIN_BYTES / weight_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
               for _ in range(copies)]
    xs = [torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _ in range(2)]

    def row(label: str, seconds: float) -> dict[str, Any]:
        bandwidth = weight_bytes / seconds
        return {"impl": label, "us": seconds * 1e6, "gb_per_s": bandwidth / 1e9,
                "pct_copy_bw": 100 * bandwidth / copy_bw}

    errors = {"torch": relative_error(F.linear(xs[0], weights[0]), xs[0], weights[0])}
    heuristic = skinny_config(m, n, k, dtype)
    errors["skinny"] = relative_error(skinny_linear(xs[0], weights[0]), xs[0], weights[0])
    result: dict[str, Any] = {
        "model": model, "op": op, "m": m, "n": n, "k": k, "dtype": str(dtype),
        "weight_mb": weight_bytes / 1e6, "copies": copies,
        "torch": row("torch", time_per_call(F.linear, xs, weights, replays)),
        "skinny": row("skinny", time_per_call(skinny_linear, xs, weights, replays)),
        "heuristic": heuristic._asdict(), "errors": errors, "failures": [],
    }
    result["skinny"]["speedup"] = result["torch"]["us"] / result["skinny"]["us"]
    if errors["skinny"] > TOLERANCE[dtype]:
        result["failures"].append(f"heuristic {heuristic}: relative error {errors['skinny']:.2e}")
    if sweep:
        tried = []
        for config in dict.fromkeys([heuristic, *sweep_grid(m, n, k, elem)]):
            def call(x, w, config=config):
                return skinny_linear(x, w, None, config)
            try:
                error = relative_error(call(xs[0], weights[0]), xs[0], weights[0])
                seconds = time_per_call(call, xs, weights, max(replays // 4, 2))
            except Exception as exc:  # a config that does not compile (e.g. shared memory)
                tried.append({"config": config._asdict(), "error": repr(exc)[:200]})
                continue
            if error > TOLERANCE[dtype]:
                result["failures"].append(f"{config}: relative error {error:.2e}")
            tried.append({"config": config._asdict(), **row("sweep", seconds),
                          "relative_error": error})
        timed = [t for t in tried if "us" in t]
        result["sweep"] = sorted(timed, key=lambda t: t["us"])
        result["sweep_errors"] = [t for t in tried if "us" not in t]
        result["best"] = result["sweep"][0] if timed else None
    del weights
    torch.cuda.empty_cache()
    return result


# FMA path (M == 1): (rows, columns, warps); BLOCK_K spans all warps at FMA_VEC elements a
# thread (else the weight goes through shared memory every step). The small-N shapes (qkv, o:
# 2048-3072 programs of 2-4 steps each at 2 rows x 1024 columns) wait a DRAM round trip a step:
# whole rows a step (4096 columns over 16 warps: every load of a program in flight at once) and
# 1-warp programs (256 columns: 4x the programs resident) are the candidates against that.
FMA_BLOCKS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (1, 2048, 4), (2, 2048, 4),
              (1, 2048, 8), (2, 2048, 8), (4, 2048, 8), (2, 512, 2), (4, 512, 2), (8, 512, 2),
              (8, 2048, 8), (2, 4096, 16), (4, 4096, 16), (8, 4096, 16), (2, 256, 1),
              (4, 256, 1), (8, 256, 1)]
# weights a thread holds in flight (rows x its columns x stages): the prefetching blocks up to
# twice the largest 1-stage block (8 rows x 2048 / 8 warps = 64); a block that spills times slow
FMA_MAX_WEIGHTS_A_THREAD = 128
# dot path: (rows, columns, stages), 4 warps; 16-32 rows also at M = 1
DOT_BLOCKS = [(16, 512, 3), (32, 256, 4), (64, 128, 4), (64, 256, 3), (128, 128, 4)]


def fp8_sweep_grid(m: int, n: int, k: int) -> list[Fp8GemvConfig]:
    """Configs worth timing for one FP8 shape (the table's / rule's pick is added by the caller):
    the FMA blocks without and with prefetch (up to FMA_MAX_WEIGHTS_A_THREAD a thread), the dot
    blocks; split K where the programs are fewer than 16 an SM."""
    def splits(blocks: int, block_k: int) -> list[int]:
        return [s for s in (1, 2, 4, 8, 16) if k // s >= block_k and (
            s == 1 or SMS <= blocks * s <= 16 * SMS and blocks < 16 * SMS)]

    grid: list[Fp8GemvConfig] = []
    if m == 1:
        for (block_n, block_k, warps), stages in itertools.product(FMA_BLOCKS, (1, 2)):
            assert block_k % (FMA_VEC * 32 * warps) == 0
            if stages * block_n * block_k // (32 * warps) > FMA_MAX_WEIGHTS_A_THREAD:
                continue
            for split in splits(math.ceil(n / block_n), block_k):
                grid.append(Fp8GemvConfig(block_n, block_k, split, warps, stages, False))
    for block_n, block_k, stages in DOT_BLOCKS:
        if m == 1 and block_n > 32:
            continue
        for split in splits(math.ceil(n / block_n), block_k):
            grid.append(Fp8GemvConfig(block_n, block_k, split, 4, stages, True))
    return grid


Job = tuple[int, int, int, Fp8GemvConfig, bool, bool, bool]  # m n k config norm gated rotary


def _compile_configs(jobs: list[Job]) -> int:
    """Worker process: run each job once on dummy tensors, filling Triton's cache for the
    timing process. Returns how many ran."""
    done = 0
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for m, n, k, config, norm, gated, rotary in jobs:
        try:
            if (n, k) not in weights:
                weights = {(n, k): (torch.zeros(n, k, device="cuda", dtype=torch.uint8).view(
                    torch.float8_e4m3fn), torch.ones(n, device="cuda"))}
            x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
            if norm:
                fp8_norm_gemv(x, RmsNormInput(x.clone(), x[0].clone(), 1e-5), *weights[n, k],
                              None, config, gated=gated,
                              rope=rotary_store(m) if rotary else None)
            else:
                fp8_gemv(x, *weights[n, k], None, config)
            torch.cuda.synchronize()
            done += 1
        except Exception:  # the timing process meets (and records) the error again
            pass
    return done


def precompile(jobs: list[Job], workers: int) -> None:
    """Compile the sweep's kernels in `workers` processes at once (Triton's cache is shared):
    compiling, not timing, is what a sweep spends its minutes on."""
    import concurrent.futures
    import multiprocessing
    import time

    start = time.perf_counter()
    chunks = [sorted(jobs[i::workers], key=lambda job: job[:3]) for i in range(workers)]
    try:
        with concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            compiled = sum(pool.map(_compile_configs, chunks))
    except Exception as exc:  # the timing loop compiles what is missing
        print(f"precompile failed ({exc!r}); compiling one config at a time", flush=True)
        return
    print(f"compiled {compiled} of {len(jobs)} kernel configs in {workers} processes: "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def bench_fp8_shape(op: str, n: int, k: int, m: int, copy_bw: float, replays: int,
                    sweep: bool, fused: bool, kv_fp8: bool = False) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    dtype = torch.bfloat16
    xs = [torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    fp8_bytes, bf16_bytes = n * k, 2 * n * k
    weights = []  # (FP8 weight, scales): copies larger than L2 together
    for _ in range(max(2, min(CALLS, math.ceil(MIN_BYTES / fp8_bytes)))):
        weights.append(fp8.quantize_rows(
            torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5))
    norm, gated, rotary = FP8_FUSED.get(op, UNFUSED) if fused else UNFUSED
    prologue = norm and m <= fp8.NORM_PROLOGUE_MAX_ROWS  # else the model's norm runs apart
    rope = rotary_store(m, kv_fp8=kv_fp8) if rotary else None
    residual = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    norm_weight = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(dtype)
    eps = 1e-5
    h = xs[0].float()
    if norm:  # float32 reference of the norm in front
        s = (h + residual.float()).to(dtype).float()
        h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    want = h @ fp8.dequantize_rows(*weights[0]).t()
    if gated:
        want = F.silu(want[:, :n // 2]) * want[:, n // 2:]
    if rope is not None:  # q rotated, float32
        heads, _, head_dim = LLAMA3_HEADS
        q = want[:, :heads * head_dim].view(m, heads, head_dim)
        cos = rope.cos[rope.positions][:, None, :]
        sin = rope.sin[rope.positions][:, None, :]
        half = head_dim // 2
        want = (q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin).reshape(m, -1)

    def error(got: torch.Tensor) -> float:
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    def row(label: str, seconds: float, weight_bytes: int) -> dict[str, Any]:
        bandwidth = weight_bytes / seconds
        return {"impl": label, "us": seconds * 1e6, "gb_per_s": bandwidth / 1e9,
                "pct_copy_bw": 100 * bandwidth / copy_bw}

    def run(config: Fp8GemvConfig | None):
        """The model's decode path: one kernel at one row, else the norm and the rotary apart
        (`fp8.norm_prologue_rows`) around the GEMM with gate_up's SiLU in its epilogue."""
        if prologue:
            norm_in = RmsNormInput(residual, norm_weight, eps)
            return lambda x, ws: fp8_norm_gemv(x, norm_in, ws[0], ws[1], None, config,
                                               gated=gated, rope=rope)[0]
        if norm:
            return lambda x, ws: apart(x, ws, config, gated_epilogue=gated)
        return lambda x, ws: fp8_gemv(x, ws[0], ws[1], None, config)

    def apart(x: torch.Tensor, ws: tuple[torch.Tensor, torch.Tensor],
              config: Fp8GemvConfig | None = None, *, gated_epilogue: bool = False
              ) -> torch.Tensor:
        """The unfused ops the fused kernel replaces: rms_norm, the GEMM, silu_and_mul
        (`gated_epilogue`: in the GEMM's epilogue) or rotary_qkv (k and v to the pool)."""
        if norm:
            x, _ = rms_norm(x, norm_weight, eps, residual)
        out = fp8_gemv(x, ws[0], ws[1], None, config, gated=gated_epilogue)
        if rope is not None:
            out, _ = rotary_qkv(rope.positions, out, rope.cos, rope.sin,
                                num_heads=rope.num_heads, num_kv_heads=rope.num_kv_heads,
                                head_dim=rope.head_dim, kv_buffers=(rope.k_buffer, rope.v_buffer),
                                slots=rope.slots, kv_scales=rope.kv_scales)
        return silu_and_mul(out) if gated and not gated_epilogue else out

    result: dict[str, Any] = {"model": FP8_MODEL, "op": op, "m": m, "n": n, "k": k,
                              "fp8_mb": fp8_bytes / 1e6, "copies": len(weights),
                              "fused": {"norm": norm, "gated": gated, "rotary": rotary,
                                        "kv_fp8": kv_fp8 and rotary},
                              "config": fp8_gemv_config(m, n, k)._asdict(), "failures": []}
    result["errors"] = {"fp8": error(run(None)(xs[0], weights[0]))}
    result["fp8"] = row("fp8", time_per_call(run(None), xs, weights, replays), fp8_bytes)
    if norm or gated or rotary:
        result["errors"]["fp8 apart"] = error(apart(xs[0], weights[0]))
        result["fp8_apart"] = row("fp8 apart", time_per_call(apart, xs, weights, replays),
                                  fp8_bytes)
    # fused ops round their bf16 outputs more than once (gate and up, then silu * up)
    tolerance = TOLERANCE[dtype] * (1.5 if norm or gated or rotary else 1.0)
    if result["errors"]["fp8"] > tolerance:
        result["failures"].append(f"{result['config']}: relative error "
                                  f"{result['errors']['fp8']:.2e}")
    half = [fp8.dequantize_rows(*ws, dtype) for ws in weights[:max(2, len(weights) // 2)]]
    result["bf16"] = row("bf16", time_per_call(skinny_linear, xs, half, replays), bf16_bytes)
    del half
    result["fp8"]["speedup_vs_bf16"] = result["bf16"]["us"] / result["fp8"]["us"]
    if sweep:
        tried = []
        for config in dict.fromkeys([fp8_gemv_config(m, n, k), *fp8_sweep_grid(m, n, k)]):
            if (prologue and config.split_k > 1) or ((gated or rotary) and config.block_n % 2):
                continue  # the fused kernel would run another config (no split; pairs)
            try:
                err = error(run(config)(xs[0], weights[0]))
                seconds = time_per_call(run(config), xs, weights, max(replays // 4, 2))
            except Exception as exc:  # a config that does not compile (e.g. shared memory)
                tried.append({"config": config._asdict(), "error": repr(exc)[:200]})
                continue
            if err > tolerance:
                result["failures"].append(f"{config}: relative error {err:.2e}")
            tried.append({"config": config._asdict(), **row("sweep", seconds, fp8_bytes),
                          "relative_error": err})
        timed = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
        result["sweep"] = timed
        timed = [t for t in timed if t["relative_error"] <= tolerance]  # best: right ones only
        result["sweep_errors"] = [t for t in tried if "us" not in t]
        result["best"] = timed[0] if timed else None
    del weights
    torch.cuda.empty_cache()
    return result


def tuned_from_sweep(path: str | Path) -> dict[tuple[int, int, int], Fp8GemvConfig]:
    """The best config per (M, N, K) of a `--fp8 --sweep` JSON, as `gemv_fp8.TUNED` entries."""
    payload = json.loads(Path(path).read_text())
    assert payload.get("benchmark") == "gemv_fp8" and payload.get("sweep"), f"{path}: no sweep"
    return {(r["m"], r["n"], r["k"]): Fp8GemvConfig(**r["best"]["config"])
            for r in payload["results"] if r.get("best") and r["m"] in (1, SKINNY_MAX_ROWS)}


def main_fp8(args: argparse.Namespace, copy_bw: float) -> int:
    _, layers, shapes = MODELS[FP8_MODEL]
    ops = args.ops or [*FP8_OPS, "lm_head"]
    rows = args.rows if args.rows_given else [1, SKINNY_MAX_ROWS]
    if args.sweep and args.jobs > 1:
        jobs = [(m, *shapes[op], config,
                 *(FP8_FUSED.get(op, UNFUSED) if not args.no_fused else UNFUSED))
                for m in rows for op in ops
                for config in dict.fromkeys([fp8_gemv_config(m, *shapes[op]),
                                             *fp8_sweep_grid(m, *shapes[op])])]
        precompile(jobs, args.jobs)
    results = []
    for m in rows:
        for op in ops:
            n, k = shapes[op]
            r = bench_fp8_shape(op, n, k, m, copy_bw, args.replays, args.sweep,
                                fused=not args.no_fused, kv_fp8=args.kv_fp8)
            results.append(r)
            best = r.get("best")
            apart = r.get("fp8_apart")
            print(f"fp8 {op:8s} M={m:2d}: bf16 {r['bf16']['us']:7.1f} us "
                  f"({r['bf16']['pct_copy_bw']:5.1f}%)  fp8 {r['fp8']['us']:7.1f} us "
                  f"({r['fp8']['pct_copy_bw']:5.1f}%, {r['fp8']['speedup_vs_bf16']:.2f}x)"
                  + (f" fused, {apart['us']:7.1f} us apart" if apart else "")
                  + (f"  best {best['us']:7.1f} us ({best['pct_copy_bw']:5.1f}%, "
                     f"{r['bf16']['us'] / best['us']:.2f}x) {tuple(best['config'].values())}"
                     if best else ""), flush=True)

    table = []
    for r in results:
        best = r.get("best")
        table.append([f"{r['op']} {r['n']}x{r['k']}", r["m"], r["fp8_mb"], r["bf16"]["us"],
                      r["bf16"]["pct_copy_bw"], r["fp8"]["us"], r["fp8"]["pct_copy_bw"],
                      r["fp8"]["speedup_vs_bf16"], tuple(r["config"].values()),
                      best["us"] if best else None, best["pct_copy_bw"] if best else None,
                      tuple(best["config"].values()) if best else None])
    print()
    print(format_table(["shape", "M", "fp8 MB", "bf16 us", "bf16 %bw", "fp8 us", "fp8 %bw",
                        "fp8/bf16", "config (bn,bk,split,warps,stages,dot)", "best us",
                        "best %bw", "best config"], table))

    # A decode step's linears: 32 layers of the FP8 ops + the LM head, which stays bf16.
    steps = {}
    for m in rows:
        got = {r["op"]: r for r in results if r["m"] == m}
        if not set(FP8_OPS) <= set(got):
            continue
        head = ([r["bf16"]["us"] for r in results if r["m"] == m and r["op"] == "lm_head"]
                or [None])[0]
        step = {"bf16": sum(got[op]["bf16"]["us"] for op in FP8_OPS) * layers,
                "fp8": sum(got[op]["fp8"]["us"] for op in FP8_OPS) * layers}
        if any("fp8_apart" in got[op] for op in FP8_OPS):  # norms and SiLU as their own kernels
            step["fp8 apart"] = sum(got[op].get("fp8_apart", got[op]["fp8"])["us"]
                                    for op in FP8_OPS) * layers
        if all(got[op].get("best") for op in FP8_OPS):
            step["fp8 best"] = sum(got[op]["best"]["us"] for op in FP8_OPS) * layers
        step = {key: us / 1e3 for key, us in step.items()}
        if head is not None:
            step = {key: ms + head / 1e3 for key, ms in step.items()}
        steps[f"M={m}"] = step
        print(f"M={m}: a step's linears ({layers} layers"
              + (" + bf16 lm_head" if head is not None else ", without lm_head") + "): "
              + ", ".join(f"{key} {ms:.3f} ms" for key, ms in step.items())
              + f"; bf16/fp8 {step['bf16'] / step['fp8']:.2f}x"
              + (f", bf16/best {step['bf16'] / step['fp8 best']:.2f}x"
                 if "fp8 best" in step else ""))
    if args.sweep:
        print("\n# best configs, for gemv_fp8.TUNED (M = 1: FMA rows; 16: every M of the dot "
              "path)")
        for r in results:
            best = r.get("best")
            if best and r["m"] in (1, SKINNY_MAX_ROWS):
                c = Fp8GemvConfig(**best["config"])
                print(f"    ({r['m']}, {r['n']}, {r['k']}): Fp8GemvConfig({c.block_n}, "
                      f"{c.block_k}, {c.split_k}, {c.num_warps}, {c.num_stages}, {c.use_dot}),"
                      f"  # {r['op']}: {best['pct_copy_bw']:.0f}% of copy")

    failures = [f"{r['op']} M={r['m']}: {f}" for r in results for f in r["failures"]]
    for failure in failures:
        print("WRONG:", failure, file=sys.stderr)
    payload = {"benchmark": "gemv_fp8", "copy_bytes_per_s": copy_bw, "calls_per_graph": CALLS,
               "sweep": args.sweep, "results": results, "step_linears_ms": steps,
               "failures": failures, "environment": environment("cuda")}
    name = "gemv_fp8_sweep.json" if args.sweep else "gemv_fp8.json"
    path = write_results(args.out or RESULTS_DIR / name, payload)
    print(f"wrote {path}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ops", nargs="+", default=None, help="qkv o gate_up down lm_head")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="M values (default 1 2 4 8 16; with --fp8: 1 16)")
    parser.add_argument("--replays", type=int, default=20, help="graph replays a timing")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs")
    parser.add_argument("--fp8", action="store_true",
                        help="Llama-3-8B's linears with FP8 weights (gemv_fp8) beside bf16")
    parser.add_argument("--device", default="cuda", choices=["cuda"])
    parser.add_argument("--no-fused", action="store_true",
                        help="--fp8: time qkv and gate_up as bare GEMMs, not as the model runs "
                             "them at decode (RMSNorm in the prologue, gate_up's SiLU fused)")
    parser.add_argument("--kv-fp8", action="store_true",
                        help="--fp8: qkv's rotary stores K/V to an FP8 pool with per-(token, "
                             "head) scales (kv_cache_dtype='fp8_e4m3'), fused and apart")
    parser.add_argument("--jobs", type=int, default=8,
                        help="--fp8 --sweep: processes compiling the kernels first (1: none)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/)")
    args = parser.parse_args()
    args.rows_given = args.rows is not None
    if args.rows is None:
        args.rows = [r for r in (1, 2, 4, 8, 16) if r <= SKINNY_MAX_ROWS]
    if not torch.cuda.is_available():
        print("bench/gemv.py needs CUDA", file=sys.stderr)
        return 2

    copy_bw = copy_bandwidth(torch.device("cuda"))
    print(f"device-to-device copy: {copy_bw / 1e12:.3f} TB/s (read + write)")
    if args.fp8:
        return main_fp8(args, copy_bw)
    results = []
    for model in args.models:
        dtype, layers, ops = MODELS[model]
        for m in args.rows:
            for op, (n, k) in ops.items():
                if args.ops and op not in args.ops:
                    continue
                r = bench_shape(model, op, n, k, m, dtype, copy_bw, args.replays, args.sweep)
                results.append(r)
                best = r.get("best")
                print(f"{model} {op:8s} M={m:2d}: torch {r['torch']['us']:8.1f} us "
                      f"({r['torch']['pct_copy_bw']:5.1f}%)  skinny {r['skinny']['us']:8.1f} us "
                      f"({r['skinny']['pct_copy_bw']:5.1f}%)"
                      + (f"  best {best['us']:8.1f} us ({best['pct_copy_bw']:5.1f}%) "
                         f"{tuple(best['config'].values())}" if best else ""), flush=True)

    table = []
    for r in results:
        best = r.get("best")
        table.append([f"{r['model']} {r['op']}", r["m"], r["weight_mb"], r["torch"]["us"],
                      r["torch"]["pct_copy_bw"], r["skinny"]["us"], r["skinny"]["pct_copy_bw"],
                      r["skinny"]["speedup"], tuple(r["heuristic"].values()),
                      best["pct_copy_bw"] if best else None,
                      tuple(best["config"].values()) if best else None,
                      f"{r['errors']['torch']:.1e}/{r['errors']['skinny']:.1e}"])
    print()
    print(format_table(["shape", "M", "weight MB", "torch us", "torch %bw", "skinny us",
                        "skinny %bw", "speedup", "heuristic (bn,bk,split,warps,stages,dot)",
                        "best %bw", "best config", "rel err torch/skinny"], table))

    # A decode step's linears (layers x (qkv, o, gate_up, down) + LM head) at each M.
    steps = {}
    for model in args.models:
        _, layers, ops = MODELS[model]
        for m in args.rows:
            rows = {r["op"]: r for r in results if r["model"] == model and r["m"] == m}
            if set(rows) != set(ops):
                continue
            step = {impl: sum(rows[op][impl]["us"] * (1 if op == "lm_head" else layers)
                              for op in ops) / 1e3 for impl in ("torch", "skinny")}
            if all(rows[op].get("best") for op in ops):
                step["best"] = sum(rows[op]["best"]["us"] * (1 if op == "lm_head" else layers)
                                   for op in ops) / 1e3
            steps[f"{model} M={m}"] = step
            print(f"{model} M={m}: a step's linears " + ", ".join(
                f"{impl} {ms:.3f} ms" for impl, ms in step.items()))

    failures = [f"{r['model']} {r['op']} M={r['m']}: {f}" for r in results for f in r["failures"]]
    for failure in failures:
        print("WRONG:", failure, file=sys.stderr)
    payload = {"benchmark": "gemv", "copy_bytes_per_s": copy_bw, "calls_per_graph": CALLS,
               "sweep": args.sweep, "results": results, "step_linears_ms": steps,
               "failures": failures, "environment": environment("cuda")}
    name = "gemv_sweep.json" if args.sweep else "gemv.json"
    path = write_results(args.out or RESULTS_DIR / name, payload)
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
