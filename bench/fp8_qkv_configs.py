"""qkv's fused FP8 GEMV at batch 1 as decode runs it (RMSNorm + residual in the prologue, the
rotary and the bf16 KV store in the epilogue), Llama-3-8B shapes, several launch configs side by
side in one process: each config's 48 calls over different weight copies (1.2 GB, past L2) in a
CUDA graph, replayed 20 times (best of three timings), two rounds; us a call and % of the copy
bandwidth of this run (bench/floor.py's). Outputs are compared with the first config's, bit for
bit.

    python bench/fp8_qkv_configs.py 2:512:1:2:1 2:512:1:2:2   # block_n:block_k:split:warps:stages
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_seconds_per_call  # noqa: E402
from bench.floor import copy_bandwidth  # noqa: E402
from lmnb.runtime.kernels.fused.gemv_fp8 import (  # noqa: E402
    Fp8GemvConfig,
    RmsNormInput,
    RotaryStore,
    fp8_norm_gemv,
)

N, K, COPIES, REPLAYS = 6144, 4096, 48, 20  # Llama-3-8B: 32 q + 2 x 8 kv heads of 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="block_n:block_k:split_k:num_warps:num_stages")
    configs = [Fp8GemvConfig(*map(int, c.split(":")), False) for c in parser.parse_args().configs]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [(torch.randn(N, K, device=dev) * 0.05).to(torch.float8_e4m3fn)
               for _ in range(COPIES)]
    scale = torch.rand(N, device=dev) * 0.01 + 0.001
    x, residual = (torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm = RmsNormInput(residual, torch.rand(K, device=dev, dtype=torch.bfloat16) + 0.5, 1e-5)
    freqs = torch.outer(torch.arange(4096.0), 5e5 ** -(torch.arange(0, 128, 2) / 128))
    cos, sin = (f(torch.cat((freqs, freqs), -1)).to(dev) for f in (torch.cos, torch.sin))
    k_pool, v_pool = (torch.zeros(2048, 8, 128, device=dev, dtype=torch.bfloat16)
                      for _ in range(2))
    rope = RotaryStore(torch.tensor([700], device=dev), cos, sin, 32, 8, 128, k_pool, v_pool,
                       torch.tensor([5], device=dev))
    bandwidth = copy_bandwidth(dev)
    first = None
    for round_ in range(2):
        for cfg in configs:
            out = fp8_norm_gemv(x, norm, weights[0], scale, None, cfg, rope=rope)[0]
            first = out.clone() if first is None else first
            us = 1e6 * graph_seconds_per_call(
                lambda i, c=cfg: fp8_norm_gemv(x, norm, weights[i], scale, None, c, rope=rope),
                calls=COPIES, replays=REPLAYS)
            print(f"round {round_} {tuple(cfg)[:5]}: {us:6.2f} us, "
                  f"{100 * N * K / (us * 1e-6) / bandwidth:5.1f}% of copy, "
                  f"output as the first config's: {torch.equal(out, first)}")


if __name__ == "__main__":
    main()
