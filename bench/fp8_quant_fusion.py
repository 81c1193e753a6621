"""The W8A8 input quantizer fused into RMSNorm and SiLU-and-mul, against the kernels apart.

At Llama-3-8B's widths (hidden 4096, intermediate 14336), rows M of a large decode batch and of
a prefill chunk: microseconds per call (CUDA graph of CALLS calls, best of 3) of
    norm   rms_norm(x, w, eps, residual) then per_token_quant   vs  rms_norm_quant
    act    silu_and_mul(gate_up) then per_token_quant           vs  silu_and_mul_quant, one block
           a row (what runs) and the two-pass loop (`row_block_max=4096`)
and whether each fused output (FP8 bytes, scales, residual) equals the unfused one bit for bit.
JSON to bench/results/fp8_quant_fusion.json (and $OUT/fp8_quant_fusion.json when $OUT is set).
    python bench/fp8_quant_fusion.py                    # on the GPU machine, < 1 minute
    python bench/fp8_quant_fusion.py --tiny             # CPU: tiny shapes in Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
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
from lmnb.runtime.kernels.fused import activation, fp8_quant, rmsnorm  # noqa: E402

CALLS = 20
Outputs = tuple[torch.Tensor | None, ...]


def time_us(fn: Callable[[], Outputs], replays: int) -> float:
    """Microseconds per call of fn() in a CUDA graph of CALLS calls (best of 3 timings)."""
    fn()
    return graph_seconds_per_call(lambda _: fn(), calls=CALLS, replays=replays) * 1e6


def _same(a: Outputs, b: Outputs) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return all((x is None and y is None) or (x is not None and y is not None
                                             and torch.equal(bits(x), bits(y)))
               for x, y in zip(a, b, strict=True))


def cases(m: int, hidden: int, width: int, device: str
          ) -> dict[str, dict[str, Callable[[], Outputs]]]:
    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, hidden, device=device, generator=gen).to(torch.bfloat16)
    res = torch.randn(m, hidden, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.rand(hidden, device=device, generator=gen) + 0.5).to(torch.bfloat16)
    gate_up = (torch.randn(m, 2 * width, device=device, generator=gen) * 2).to(torch.bfloat16)

    def norm_apart() -> Outputs:
        normed, stream = rmsnorm.rms_norm(x, w, 1e-5, res)
        return (*fp8_quant.per_token_quant(normed), stream)

    def act_apart() -> Outputs:
        return fp8_quant.per_token_quant(activation.silu_and_mul(gate_up))

    return {
        "norm": {"apart": norm_apart,
                 "fused": lambda: rmsnorm.rms_norm_quant(x, w, 1e-5, res)},
        "act": {"apart": act_apart,
                "fused": lambda: activation.silu_and_mul_quant(gate_up),
                "fused, two passes": lambda: activation.silu_and_mul_quant(
                    gate_up, row_block_max=min(4096, width // 2))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="234,2048,8192", help="M values, comma-separated")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, Triton's interpreter: rows 17, hidden 64, intermediate 96; "
                             "equality only")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    rows = [17] if args.tiny else [int(r) for r in args.rows.split(",")]
    hidden, width = (64, 96) if args.tiny else (args.hidden, args.intermediate)
    table, results = [], []
    for m in rows:
        for op, variants in cases(m, hidden, width, device).items():
            want = variants["apart"]()
            base = None
            for name, fn in variants.items():
                us = None if args.tiny else time_us(fn, args.replays)
                base = base or us
                equal = _same(fn(), want)
                results.append({"m": m, "op": op, "variant": name, "us": us, "bit_equal": equal})
                table.append([m, op, name, us, base / us if us else None, equal])
    print(format_table(["M", "op", "variant", "us/call", "speed-up", "bits equal"], table))
    payload = {"environment": environment(device), "hidden": hidden, "intermediate": width,
               "results": results}
    write_results(RESULTS_DIR / "fp8_quant_fusion.json", payload)
    return 0 if all(r["bit_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
