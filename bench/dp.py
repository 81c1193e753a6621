"""Data-parallel offline throughput: `Runtime(..., dp_size=2)` (two replica processes, one GPU
each, behind the cache-aware router) against one in-process `Runtime` on one GPU, on
nano-vllm's offline workload (bench/offline.py's: N random prompts, lengths uniform in
[100, 1024], `ignore_eos`, temperature 0.6), every prompt in one `generate` call.

On a two-GPU machine (random Llama-2-7B weights, the SmolLM2 tokenizer only detokenizes):

    python bench/dp.py --dummy-config llama-2-7b --tokenizer <SmolLM2 tokenizer folder>

(the replicas are `python -m lmnb serve` children: fastapi, uvicorn, pydantic and httpx must be
importable there).

The DP replicas run first (the bench process stays off the GPUs until they are gone), then the
single runtime on GPU 0. `--dp1` adds the router over one replica (GPU 0): the cost of the
process + HTTP transport itself. Replicas get GPUs in `CUDA_VISIBLE_DEVICES` order. On CPU (a
smoke test: `--num-seqs 8 --max-input-len 64 --max-output-len 16`) the replicas share the cores,
so expect no speed-up there.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.offline import (  # noqa: E402
    DUMMY_CONFIGS,
    SEED,
    WARMUP_TOKENS,
    Workload,
    add_workload_args,
    check_workload_args,
    model_spec,
    workload_from_args,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp-size", type=int, default=2)
    add_workload_args(parser)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="local HF folder or .gguf")
    model.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default=None,
                       help="random weights of this architecture (load_format='dummy')")
    parser.add_argument("--tokenizer", default=None,
                        help="HF folder whose tokenizer goes with --dummy-config")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--dp1", action="store_true",
                        help="also run the router over one replica (transport cost)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "dp.json")
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.dp_size < 2:
        parser.error("--dp-size must be >= 2")
    if args.tokenizer is not None and args.dummy_config is None:
        parser.error("--tokenizer goes with --dummy-config")
    return args


def _options(spec: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": spec.dtype, "device": device,
                               "load_format": "dummy" if spec.dummy else "auto"}
    if spec.tokenizer_dir is not None:
        options["tokenizer_path"] = str(spec.tokenizer_dir)
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    return options


def _measure(runtime: Any, workload: Workload, args: argparse.Namespace,
             replicas: int) -> dict[str, Any]:
    """Warm-up (every replica), flush, then the whole workload in one generate call."""
    params = workload.sampling_params(args.temperature)
    warm = {**params[0], "max_new_tokens": WARMUP_TOKENS}
    runtime.generate(input_ids=[workload.prompts[i][:16] for i in range(replicas)],
                     sampling_params=warm)  # distinct prompts: one per replica
    runtime.flush_cache()
    start = time.perf_counter()  # generate returns when every output is back: no sync needed
    outputs = runtime.generate(input_ids=workload.prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    produced = [out["meta_info"]["completion_tokens"] for out in outputs]
    ranks = [out["meta_info"].get("dp_rank", 0) for out in outputs]
    return {"replicas": replicas, "seqs": len(outputs), "output_tokens": sum(produced),
            "seconds": seconds, "tokens_per_s": sum(produced) / seconds,
            "short_seqs": sum(p < n for p, n in zip(produced, workload.output_lens,
                                                    strict=True)),
            "seqs_per_replica": [ranks.count(r) for r in range(replicas)],
            "output_tokens_per_replica": [sum(p for p, r in zip(produced, ranks, strict=True)
                                              if r == k) for k in range(replicas)]}


def run_dp(spec: Any, workload: Workload, args: argparse.Namespace, device: str,
           dp_size: int) -> dict[str, Any]:
    from lmnb.runtime.distributed.dp_runtime import DataParallelRuntime

    start = time.perf_counter()
    runtime = DataParallelRuntime(spec.model_dir, dp_size=dp_size,
                                  **_options(spec, args, device))
    load = time.perf_counter() - start
    try:
        if max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens,
                                          strict=True)) > runtime.context_len:
            raise SystemExit(f"a sequence does not fit the context ({runtime.context_len})")
        result = _measure(runtime, workload, args, dp_size)
        result["router"] = runtime.stats()["router"]
    finally:
        runtime.close()
    return {**result, "load_seconds": load}


def run_single(spec: Any, workload: Workload, args: argparse.Namespace,
               device: str) -> dict[str, Any]:
    import torch

    from lmnb.runtime.engine import Runtime

    start = time.perf_counter()
    runtime = Runtime(spec.model_dir, **_options(spec, args, device))
    load = time.perf_counter() - start
    try:
        torch.manual_seed(SEED)
        result = _measure(runtime, workload, args, 1)
    finally:
        runtime.close()
        del runtime
        gc.collect()
    return {**result, "load_seconds": load}


def _check_server_packages() -> None:
    """Replicas are `python -m lmnb serve` children: the server extra must be importable."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "httpx", "pydantic")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"bench/dp.py needs {', '.join(missing)} (pip install 'lmnb[server]'; "
                         "offline: carry wheels of fastapi, starlette, uvicorn, pydantic, "
                         "pydantic-core, annotated-types, typing-inspection, opentelemetry-api)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _check_server_packages()
    warnings.filterwarnings("ignore", module="transformers")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # torch.cuda.device_count() does not create a CUDA context: the replicas get the GPUs whole
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.device_count() > 0 else "cpu"
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if device.startswith("cuda") and gpus < args.dp_size:
        print(f"warning: {gpus} GPU(s) for {args.dp_size} replicas: replicas share GPUs")
    with tempfile.TemporaryDirectory(prefix="lmnb-bench-dp-") as scratch:
        spec = model_spec(args, Path(scratch), torch.device("cpu") if device == "cpu"
                          else torch.device("cuda"))
        workload = workload_from_args(args, spec.config.vocab_size)
        print(f"dp: {args.num_seqs} seqs, {workload.prompt_tokens:,} prompt tokens, "
              f"{workload.output_tokens:,} output tokens; {spec.label}, {spec.dtype}, {device}")
        results: dict[str, Any] = {}
        results[f"dp{args.dp_size}"] = run_dp(spec, workload, args, device, args.dp_size)
        if args.dp1:
            results["dp1_router"] = run_dp(spec, workload, args, device, 1)
        results["one_runtime"] = run_single(spec, workload, args, device)

    names = {f"dp{args.dp_size}": f"DP={args.dp_size} (router + {args.dp_size} replicas)",
             "dp1_router": "router + 1 replica", "one_runtime": "one Runtime (in process)"}
    rows = [(names[k], r["seqs"], r["output_tokens"], r["seconds"], r["tokens_per_s"])
            for k, r in results.items()]
    print(format_table(["system", "seqs", "output tokens", "seconds", "tokens/s"], rows))
    dp_key = f"dp{args.dp_size}"
    ratio = results[dp_key]["tokens_per_s"] / results["one_runtime"]["tokens_per_s"]
    print(f"DP={args.dp_size} / one runtime throughput: {ratio:.2f}x "
          f"(sequences per replica {results[dp_key]['seqs_per_replica']})")
    for key, result in results.items():
        if result["short_seqs"]:
            print(f"warning: {result['short_seqs']} {names[key]} sequences got fewer tokens "
                  "than requested")
    payload = {
        "benchmark": "dp",
        "config": {"model": spec.label, "dtype": str(spec.dtype).removeprefix("torch."),
                   "dp_size": args.dp_size, "num_seqs": args.num_seqs,
                   "input_len": [args.min_input_len, args.max_input_len],
                   "output_len": [args.min_output_len, args.max_output_len],
                   "temperature": args.temperature, "ignore_eos": True, "seed": SEED,
                   "max_total_tokens": args.max_total_tokens, "gpus": gpus},
        "workload": {"prompt_tokens": workload.prompt_tokens,
                     "output_tokens": workload.output_tokens},
        "results": results,
        f"ratio_dp{args.dp_size}_over_one": ratio,
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
