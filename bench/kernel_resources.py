"""Registers, spills and shared memory of the Triton decode-attention kernel's configs, compiled
for an H100/H200 (sm_90) on a machine without a GPU, and the programs an SM can hold.

A config's speed on the device depends on what ptxas made of it: a tile that needs more than
255 registers a thread spills to local memory (`stack` bytes a thread), and registers or shared
memory bound how many programs run on an SM at once. This compiles `_decode_partial_kernel` as
`decode_attention` launches it (the constants of `decode_config` at each batch size, plus any
`--tiles`) with Triton's own ptxas, reads `cuobjdump -res-usage` and prints, per config:
registers, stack, shared memory, programs a SM, and the waves a batch's (request, KV head) grid
takes over 132 SMs. No GPU is needed; the device's Triton may allocate differently (run it there
too when a sweep disagrees).

    python bench/kernel_resources.py --model llama3 --batches 1,16,64,256
    python bench/kernel_resources.py --model llama3 --batches 64 --tiles 64:4:2,64:4:3,128:8:2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # kernels defined for code generation, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.common import RESULTS_DIR, format_table, write_json  # noqa: E402
from lmnb.runtime.kernels import triton_decode  # noqa: E402
from lmnb.runtime.kernels.triton_decode import DecodeConfig, decode_config  # noqa: E402

MODELS = {"llama3": (32, 8, 128, torch.bfloat16), "llama2": (32, 32, 128, torch.float16)}
SMS = 132  # H100 SXM and H200
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024  # a block's reserved shared memory on sm_90
MAX_BLOCKS_PER_SM = 32
MAX_WARPS_PER_SM = 64
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_partial(config: DecodeConfig, *, group: int, head_dim: int, dtype: torch.dtype,
                    max_splits: int) -> dict[str, int]:
    """`_decode_partial_kernel` compiled for sm_90 with `config`: its resources."""
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = triton_decode.partial_kernel_types(q="*" + dtype_name, kv="*" + dtype_name)
    constants: dict[str, Any] = {
        "GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
        "BLOCK_H": triton_decode.query_rows(group), "BLOCK_N": config.block_n,
        "MAX_SPLITS": max_splits, "MIN_SPLIT": config.min_split, "PRECISION": "tf32",
        "UPCAST": False, "HAS_SKIP": False, "KV_FP8": False, "PREFETCH": config.prefetch,
        "K_ROWS": config.k_rows, "HEADS_FIRST": config.heads_first, "USE_PDL": True}
    signature.update({name: "constexpr" for name in constants})
    kernel = triton.compile(
        ASTSource(fn=triton_decode._decode_partial_kernel, signature=signature,
                  constexprs=constants, attrs={}),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(_CUOBJDUMP), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found is not None, usage
    registers, stack = int(found.group(1)), int(found.group(2))
    shared = int(kernel.metadata.shared)
    threads = 32 * config.num_warps
    per_sm = min(REGISTERS_PER_SM // (registers * threads),
                 SHARED_PER_SM // (shared + SHARED_RESERVED),
                 MAX_WARPS_PER_SM // config.num_warps, MAX_BLOCKS_PER_SM)
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared,
            "programs_per_sm": per_sm}


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    tiles = []
    for item in filter(None, text.split(",")):
        block_n, warps, stages = (int(v) for v in item.split(":"))
        tiles.append((block_n, warps, stages))
    return tiles


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3")
    parser.add_argument("--batches", default="1,16,64,256",
                        help="comma list of batch sizes: decode_config's pick at each")
    parser.add_argument("--tiles", default="",
                        help="block_n:warps:stages,... also compiled at each batch (the pick's "
                             "other fields kept)")
    parser.add_argument("--max-splits", type=int, default=16,
                        help="the backend's split grid before the config caps it")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "kernel_resources.json")
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim, dtype = MODELS[args.model]
    rows, records = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        pick = decode_config(head_dim, dtype, batch_size=batch, num_kv_heads=kv_heads,
                             sm_count=SMS)
        configs = [("pick", pick)] + [
            (f"{n}:{w}:{s}", pick._replace(block_n=n, num_warps=w, num_stages=s))
            for n, w, s in parse_tiles(args.tiles)]
        programs = batch * kv_heads
        for label, config in configs:
            splits = min(args.max_splits, config.max_splits)
            usage = compile_partial(config, group=heads // kv_heads, head_dim=head_dim,
                                    dtype=dtype, max_splits=splits)
            waves = programs / (SMS * usage["programs_per_sm"])
            rows.append([batch, label, config.block_n, config.num_warps, config.num_stages,
                         int(config.prefetch), int(config.k_rows), splits,
                         usage["registers"], usage["stack_bytes"], usage["shared_bytes"],
                         usage["programs_per_sm"], programs, round(waves, 2)])
            records.append({"batch": batch, "label": label, "config": config._asdict(),
                            "max_splits": splits, **usage, "programs": programs,
                            "waves_one_split": waves})
    print(format_table(["batch", "config", "block_n", "warps", "stages", "prefetch", "k_rows",
                        "splits", "regs", "stack B", "shared B", "progs/SM", "programs",
                        "waves (1 split)"], rows))
    payload = {"benchmark": "kernel_resources", "model": args.model, "target": "sm_90",
               "triton": triton.__version__, "rows": records}
    print(f"wrote {write_json(args.json, payload)}")
    return payload


if __name__ == "__main__":
    main()
