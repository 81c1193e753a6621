"""Batch-1 decode beside the HBM floor, as an ablation: CUDA graphs off / on with each attention
backend, fused kernels on / off (GPU).

One request of a 128-token prompt and 256 new tokens (`ignore_eos`, greedy) on random weights of
a real architecture (default Llama-2-7B fp16). A decode step's time is (T(1 + 256 tokens) -
T(1 token)) / 256, the fastest of a few runs each, so the prefill and the first token drop out.
The floor is the weight bytes one step reads / the device-to-device copy bandwidth, both
measured in the same run (the KV the step reads, under 0.2 GB here, is left out of the floor as
the issue defines it, and reported). Eager modes also count the CUDA kernels per decode step
(torch profiler over 8 steps).

    python bench/decode_ablation.py --tokenizer .gpu/tokenizer
    python bench/decode_ablation.py --tokenizer .gpu/tokenizer --modes graphs-triton --fused on
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402
from bench.floor import copy_bandwidth  # noqa: E402
from lmnb.runtime.models import loader  # noqa: E402

PROMPT_LEN = 128
NEW_TOKENS = 256

# label -> Runtime options (fused kernels on and off are crossed with each)
MODES: dict[str, dict[str, Any]] = {
    "eager": {"disable_cuda_graph": True},  # the default backend (auto), no graphs
    "graphs-torch_native": {"attention_backend": "torch_native", "cuda_graph_max_bs": 1},
    "graphs-triton": {"attention_backend": "triton"},
    "graphs-flashinfer": {"attention_backend": "flashinfer"},
}


def kernels_per_decode_step(rt: Any, prompt: list[int], steps: int = 8) -> float:
    """CUDA kernels per decode step: a profiled request of `steps` decode steps, less a profiled
    prefill-only request."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(new_tokens: int) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rt.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "ignore_eos": True, "max_new_tokens": new_tokens})
        return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")

    return (kernels(steps + 1) - kernels(1)) / steps


def decode_run(folder: Path, tokenizer: str, device: torch.device, dtype: str,
               options: dict[str, Any], repeats: int, count_kernels: bool) -> dict[str, Any]:
    from lmnb.runtime.engine import Runtime

    with Runtime(str(folder), tokenizer_path=tokenizer, load_format="dummy", device=str(device),
                 dtype=dtype, context_length=PROMPT_LEN + NEW_TOKENS + 16,
                 max_running_requests=4, **options) as rt:
        stats = rt.stats()
        prompt = list(range(100, 100 + PROMPT_LEN))

        def timed(new_tokens: int) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = rt.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "ignore_eos": True, "max_new_tokens": new_tokens})
            assert out["meta_info"]["completion_tokens"] == new_tokens
            return time.perf_counter() - start

        timed(8)  # warm-up: kernels compiled, allocator primed
        first = min(timed(1) for _ in range(3))
        whole = min(timed(1 + NEW_TOKENS) for _ in range(repeats))
        result = {
            "attention_backend": stats["attention_backend"],
            "cuda_graphs": bool(stats["cuda_graph_batch_sizes"]),
            "fused_kernels": stats.get("fused_kernels"),
            "weight_bytes": rt.weight_bytes,
            "kv_bytes_per_token": (2 * rt.model_config.num_layers * rt.model_config.num_kv_heads
                                   * rt.model_config.head_dim
                                   * torch.empty((), dtype=getattr(torch, dtype)).element_size()),
            "prefill_and_first_token_ms": 1e3 * first,
            "request_seconds": whole,
            "decode_step_ms": 1e3 * (whole - first) / NEW_TOKENS,
        }
        if count_kernels:
            result["kernels_per_decode_step"] = kernels_per_decode_step(rt, prompt)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b", choices=sorted(DUMMY_CONFIGS))
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the tokenizer files (default: the embedded SmolLM2)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--fused", default="on,off", help="on, off or on,off")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path,
                        default=RESULTS_DIR / "decode_ablation.json")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    args.fused = [f.strip() for f in args.fused.split(",") if f.strip()]
    if not args.fused or set(args.fused) - {"on", "off"}:
        parser.error("--fused: on, off or on,off")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_ablation needs a CUDA device (the floor is HBM bandwidth)")
    device = torch.device("cuda")
    fields = DUMMY_CONFIGS[args.model_config]
    tokenizer = str(args.tokenizer or loader.resolve_model_dir(None))
    bandwidth = copy_bandwidth(device)
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / args.model_config
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(fields))
        for mode in args.modes:
            if mode == "graphs-flashinfer" and importlib.util.find_spec("flashinfer") is None:
                print(f"{mode}: skipped (flashinfer is not installed)", flush=True)
                continue
            for fused in args.fused:
                options = {**MODES[mode], "disable_fused_kernels": fused == "off"}
                result = decode_run(folder, tokenizer, device, fields["dtype"], options,
                                    args.repeats, count_kernels=mode == "eager")
                floor_ms = 1e3 * result["weight_bytes"] / bandwidth
                result["hbm_floor_ms"] = floor_ms
                result["fraction_of_floor"] = floor_ms / result["decode_step_ms"]
                result["decode_tokens_per_s"] = 1e3 / result["decode_step_ms"]
                result["request_tokens_per_s"] = NEW_TOKENS / result["request_seconds"]
                label = f"{mode}, fused {fused}"
                runs[label] = result
                rows.append([label, result["attention_backend"], result["decode_step_ms"],
                             result["decode_tokens_per_s"], result["request_tokens_per_s"],
                             f"{100 * result['fraction_of_floor']:.1f}%",
                             result.get("kernels_per_decode_step")])
                print(f"{label}: {result['decode_step_ms']:.2f} ms/step "
                      f"({100 * result['fraction_of_floor']:.1f}% of the floor)", flush=True)
    bandwidth_after = copy_bandwidth(device)
    weight_gb = next(iter(runs.values()))["weight_bytes"] / 1e9 if runs else 0.0
    print(f"batch-1 decode, random {args.model_config} ({fields['dtype']}, {weight_gb:.2f} GB "
          f"of weights), {PROMPT_LEN}-token prompt, {NEW_TOKENS} new tokens; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (again at the end: {bandwidth_after / 1e12:.2f}); "
          f"HBM floor {1e3 * weight_gb * 1e9 / bandwidth:.2f} ms/step")
    print(format_table(["mode", "backend", "ms/step", "decode tok/s", "request tok/s",
                        "of floor", "kernels/step"], rows))
    for mode in args.modes:
        on, off = runs.get(f"{mode}, fused on"), runs.get(f"{mode}, fused off")
        if on and off:
            print(f"{mode}: fused kernels {off['decode_step_ms'] / on['decode_step_ms']:.2f}x "
                  "faster per step")
    payload = {"benchmark": "decode_ablation", "model": args.model_config,
               "dtype": fields["dtype"], "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
               "copy_bytes_per_s": bandwidth, "copy_bytes_per_s_after": bandwidth_after,
               "runs": runs, "environment": environment(device)}
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
