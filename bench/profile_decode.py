"""Where a decode step's time goes: torch profiler over --batch requests (1 prefill + N decode
steps) on random weights of a real architecture; prints kernel launches per step, device time by
kernel category (bench/kernel_profile.py) and the host-side table (GPU). With programmatic
dependent launch (kernels/pdl.py) a kernel starts before the one in front ends and its recorded
time includes that wait (a split-K reduce shows the whole GEMM's time); `--no-pdl` launches
without it, so each kernel's time is its own.

    python bench/profile_decode.py --model-config llama-2-7b --tokenizer <tokenizer folder>
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from bench.kernel_profile import (  # noqa: E402
    CATEGORY_HEADERS,
    category_rows,
    device_events,
    summarize,
)
from lmnb.runtime.engine import Runtime  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b", choices=sorted(DUMMY_CONFIGS))
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-fused-kernels", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (Runtime's option)")
    parser.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_e4m3")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch (LMNB_DISABLE_PDL=1)")
    args = parser.parse_args(argv)
    if args.no_pdl:
        os.environ["LMNB_DISABLE_PDL"] = "1"
    quant = {key: value for key, value in (("quantization", args.quantization),
                                           ("kv_cache_dtype", args.kv_cache_dtype)) if value}
    with tempfile.TemporaryDirectory() as scratch:
        dummy = write_dummy_model(args.model_config, scratch, args.tokenizer, grow_vocab=False)
        with Runtime(str(dummy.path), **dummy.runtime_options(), device="cuda",
                     attention_backend=args.attention_backend,
                     disable_cuda_graph=args.disable_cuda_graph,
                     disable_fused_kernels=args.disable_fused_kernels, **quant) as rt:
            params = {"temperature": 0, "ignore_eos": True}
            prompts = [list(range(100 + i, 356 + i)) for i in range(args.batch)]
            rt.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 8})
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                rt.generate(input_ids=prompts,
                            sampling_params={**params, "max_new_tokens": args.steps + 1})
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    passes = args.steps + 1
    print(f"CUDA kernels for 1 prefill + {args.steps} decode steps at batch {args.batch}: "
          f"{kernels} (~{kernels / passes:.0f} per pass)")
    summary = summarize(device_events(prof), wall_seconds=0.0, passes=passes)
    print(format_table(CATEGORY_HEADERS, category_rows(summary)))
    print(format_table(["kernel", "category", "count", "us per pass"],
                       [[k["name"][:90], k["category"], k["count"], 1e6 * k["seconds"] / passes]
                        for k in summary["top_kernels"]]))
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


if __name__ == "__main__":
    main()
