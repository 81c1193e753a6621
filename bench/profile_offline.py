"""Where the offline workload's time goes (GPU): torch profiler over windows of the scheduler's
passes in nano-vllm's offline run (bench/offline.py's workload, default 256 sequences on random
Llama-3-8B bf16), kernels summarised by category, GPU busy time against wall time, and the floor of
the window's own passes (bench/floor.py) beside them.

The run is the real one: the whole workload in one `generate` call. The scheduler's batch hook
counts finished passes; a window `START:N` starts the profiler when pass START finishes and stops
it when pass START + N does (on the scheduler thread, so the stop's processing stalls the run for
a moment, outside the window). Per window: passes by mode and batch size, wall ms per pass
(host + device, what the run spends), busy ms per pass (the union of device intervals), idle
(host-bound gaps: the device waits for the scheduler), kernel time by category, the top kernels,
and the floor of the same passes, so that wall - floor splits into kernels above their floor and
idle time.

    python bench/profile_offline.py --tokenizer .gpu/tokenizer                    # Llama-3-8B
    python bench/profile_offline.py --dummy-config llama-2-7b --tokenizer .gpu/tokenizer
    python bench/profile_offline.py --model tiny_dir --device cpu --num-seqs 4 \\
        --max-input-len 32 --max-output-len 16 --windows 2:4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    stopwatch,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from bench.floor import BatchLog, ModelCost, measure_rates, schedule_floor  # noqa: E402
from bench.kernel_profile import (  # noqa: E402
    CATEGORY_HEADERS,
    category_rows,
    device_events,
    summarize,
)
from bench.offline import (  # noqa: E402
    SEED,
    WARMUP_TOKENS,
    add_workload_args,
    check_workload_args,
    workload_from_args,
)
from lmnb.runtime.core import Batch, ForwardMode  # noqa: E402


def parse_windows(text: str) -> list[tuple[int, int]]:
    """'100:40,700:40' -> [(100, 40), (700, 40)]: profile passes 101..140 and 701..740 (counted
    from 1); windows must be in order and apart."""
    windows = []
    for part in text.split(","):
        start, _, count = part.strip().partition(":")
        if not start.isdigit() or not count.isdigit() or int(count) < 1:
            raise ValueError(f"window {part!r}: START:PASSES with PASSES >= 1")
        windows.append((int(start), int(count)))
    for (s1, n1), (s2, _) in zip(windows, windows[1:], strict=False):
        if s2 < s1 + n1:
            raise ValueError("windows must be in order and must not overlap")
    return windows


class WindowProfiler:
    """The batch hook: counts finished passes and runs the profiler over each window."""

    def __init__(self, windows: list[tuple[int, int]], activities: list[Any]) -> None:
        self.windows = windows
        self.activities = activities
        self.finished = 0
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._current: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, batch: Batch) -> None:
        try:
            with self._lock:
                self._on_pass(batch)
        except BaseException as error:  # never break the scheduler; reported after the run
            self.error = self.error or error

    def _on_pass(self, batch: Batch) -> None:
        self.finished += 1
        current = self._current
        if current is not None:
            current["log"](batch)
            if self.finished == current["start"] + current["passes"]:
                self._stop()
            return
        for start, passes in self.windows:
            if self.finished == start:
                from torch.profiler import profile

                prof = profile(activities=self.activities)
                self._current = {"start": start, "passes": passes, "log": BatchLog(),
                                 "prof": prof}
                prof.start()
                self._current["t0"] = time.perf_counter()

    def _stop(self) -> None:
        current, self._current = self._current, None
        assert current is not None
        wall = time.perf_counter() - current["t0"]
        current["prof"].stop()
        self.results.append({"start": current["start"], "passes": current["passes"],
                             "wall_seconds": wall, "log": current["log"],
                             "events": device_events(current["prof"])})

    def finish(self) -> list[tuple[int, int]]:
        """After the run: stops a window the run ended inside (started on the scheduler thread,
        its capture is not trusted from this one, so it is dropped) and returns the windows that
        were not profiled."""
        with self._lock:
            if self._current is not None:
                self._current.pop("prof").stop()
                self._current = None
        done = {r["start"] for r in self.results}
        return [w for w in self.windows if w[0] not in done]


def schedule_shape(log: BatchLog) -> dict[str, Any]:
    """Passes by mode; decode batch sizes (min / mean / max); prefill tokens per pass."""
    decode = [len(extend) for mode, _, extend, _ in log.passes if mode is ForwardMode.DECODE]
    extend = [sum(extend) for mode, _, extend, _ in log.passes if mode is not ForwardMode.DECODE]
    return {"decode_passes": len(decode), "extend_passes": len(extend),
            "decode_batch": ([min(decode), sum(decode) / len(decode), max(decode)]
                             if decode else None),
            "extend_tokens_per_pass": sum(extend) / len(extend) if extend else None}


def batch_size_histogram(log: BatchLog, bucket: int = 32) -> dict[str, int]:
    """Decode passes of the whole run by batch size bucket ('1-32', '33-64', ...)."""
    counts = Counter((len(extend) - 1) // bucket for mode, _, extend, _ in log.passes
                     if mode is ForwardMode.DECODE)
    return {f"{b * bucket + 1}-{(b + 1) * bucket}": counts[b] for b in sorted(counts)}


class _Both:
    """Two batch hooks in one (the window profiler and the whole run's log)."""

    def __init__(self, *hooks: Any) -> None:
        self.hooks = hooks

    def __call__(self, batch: Batch) -> None:
        for hook in self.hooks:
            hook(batch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--dummy-config", default="llama-3-8b", choices=sorted(DUMMY_CONFIGS))
    model.add_argument("--model", default=None, help="a local HF folder instead (CPU checks)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto")
    add_workload_args(parser)
    parser.add_argument("--windows", default="10:30,150:40,700:40",
                        help="START:PASSES,...: profile the passes after pass START "
                             "(default: prefill-heavy start, full decode batch, late decode)")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--disable-fused-kernels", action="store_true")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (Runtime's option)")
    parser.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_e4m3")
    parser.add_argument("--top", type=int, default=15, help="top kernels printed per window")
    parser.add_argument("--output", type=Path, default=None,
                        help="default bench/results/profile_offline_<model>.json")
    args = parser.parse_args(argv)
    if args.model is not None:
        args.dummy_config = None
        if args.tokenizer is not None:
            parser.error("--tokenizer goes with --dummy-config")
    try:
        args.windows = parse_windows(args.windows)
    except ValueError as error:
        parser.error(f"--windows: {error}")
    check_workload_args(parser, args)
    if args.output is None:
        name = args.dummy_config or Path(args.model).name
        args.output = RESULTS_DIR / f"profile_offline_{name}.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from torch.profiler import ProfilerActivity, profile

    from lmnb.runtime.engine import Runtime

    device = resolve_device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with tempfile.TemporaryDirectory(prefix="lmnb-profile-") as scratch:
        if args.dummy_config is not None:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer,
                                      grow_vocab=False)
            model_path, options, label = str(dummy.path), dummy.runtime_options(), dummy.label
        else:
            model_path, options, label = args.model, {}, args.model
        rt = Runtime(model_path, device=str(device), max_total_tokens=args.max_total_tokens,
                     attention_backend=args.attention_backend,
                     disable_cuda_graph=args.disable_cuda_graph,
                     disable_fused_kernels=args.disable_fused_kernels,
                     **({"quantization": args.quantization} if args.quantization else {}),
                     **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
                     **({"disable_overlap_schedule": True} if args.disable_overlap_schedule
                        else {}), **options)
        try:
            stats = rt.stats()
            cost = ModelCost.from_config(rt.model_config, rt.dtype)
            rates = (measure_rates(device, rt.model_config, rt.dtype) if device.type == "cuda"
                     else None)
            workload = workload_from_args(args, rt.model_config.vocab_size)
            params = workload.sampling_params(args.temperature)
            torch.manual_seed(SEED)
            rt.generate(input_ids=workload.prompts[0][:16],
                        sampling_params={**params[0], "max_new_tokens": WARMUP_TOKENS})
            rt.flush_cache()
            with profile(activities=activities):  # kineto initialises on this thread, not
                torch.zeros(1, device=device)        # inside the scheduler's first window
            profiler, whole = WindowProfiler(args.windows, activities), BatchLog()
            rt.set_batch_hook(_Both(whole, profiler))
            try:
                with stopwatch(device) as run:
                    rt.generate(input_ids=workload.prompts, sampling_params=params)
            finally:
                rt.set_batch_hook(None)
            missed = profiler.finish()
        finally:
            rt.close()
    if profiler.error is not None:
        raise RuntimeError("the window profiler failed") from profiler.error

    print(f"profile_offline: {label}, {rt.dtype}, {device}; {args.num_seqs} seqs; backend "
          f"{stats['attention_backend']}, graphs {bool(stats['cuda_graph_batch_sizes'])}, "
          f"overlap {stats['overlap_schedule']}, fused {stats['fused_kernels']}; "
          f"{len(whole.passes)} passes in {run['seconds']:.1f} s (profiled windows included)")
    print(f"decode passes by batch size: {batch_size_histogram(whole)}")
    if missed:
        print(f"warning: windows {missed} not profiled: the run ended before they did "
              f"({len(whole.passes)} passes)")
    windows = []
    for window in profiler.results:
        summary = summarize(window["events"], wall_seconds=window["wall_seconds"],
                            passes=len(window["log"].passes), top=args.top)
        summary["window"] = [window["start"], window["passes"]]
        summary["schedule"] = schedule_shape(window["log"])
        if rates is not None:
            floor = schedule_floor(window["log"], cost, **rates)
            summary["floor"] = floor
            summary["floor_ms_per_pass"] = 1e3 * floor["seconds"] / max(summary["passes"], 1)
            summary["fraction_of_floor"] = (floor["seconds"] / summary["wall_seconds"]
                                            if summary["wall_seconds"] else None)
        windows.append(summary)
        shape = summary["schedule"]
        print(f"\nwindow: passes {window['start'] + 1}-{window['start'] + summary['passes']} "
              f"({shape['decode_passes']} decode, batch min/mean/max {shape['decode_batch']}; "
              f"{shape['extend_passes']} prefill)")
        print(f"  per pass: wall {summary['wall_ms_per_pass']:.2f} ms, device busy "
              f"{summary['busy_ms_per_pass']:.2f} ms, idle {summary['idle_ms_per_pass']:.2f} ms "
              f"({summary['kernels_per_pass']:.0f} device events)"
              + (f", floor {summary['floor_ms_per_pass']:.2f} ms "
                 f"({100 * summary['fraction_of_floor']:.1f}% of floor)"
                 if rates is not None else ""))
        print(format_table(CATEGORY_HEADERS, category_rows(summary)))
        print(format_table(["kernel", "category", "count", "ms"],
                           [[k["name"][:90], k["category"], k["count"], 1e3 * k["seconds"]]
                            for k in summary["top_kernels"]]))
        if (device.type == "cuda" and stats["cuda_graph_batch_sizes"]
                and shape["decode_passes"] and summary["kernels_per_pass"] < 50):
            print("  warning: few device events per pass: the profiler may not see kernels "
                  "inside CUDA graphs here; rerun with --disable-cuda-graph to compare")
    payload = {
        "benchmark": "profile_offline", "model": label,
        "dtype": str(rt.dtype).removeprefix("torch."),
        "config": {"num_seqs": args.num_seqs, "input_len": [args.min_input_len,
                                                            args.max_input_len],
                   "output_len": [args.min_output_len, args.max_output_len],
                   "temperature": args.temperature, "windows": args.windows,
                   "attention_backend": stats["attention_backend"],
                   "cuda_graphs": bool(stats["cuda_graph_batch_sizes"]),
                   "overlap_schedule": stats["overlap_schedule"],
                   "fused_kernels": stats["fused_kernels"]},
        "rates": rates,
        "run": {"passes": len(whole.passes), "seconds_with_profiling": run["seconds"],
                "decode_batch_histogram": batch_size_histogram(whole),
                **schedule_shape(whole)},
        "windows": windows,
        "windows_not_profiled": missed,
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
