"""The host cost of the DSL path per program, on a model that costs nearly nothing.

`bench/programs.py`'s MMLU workload (its own builders and programs) runs through `run_batch` on a
`LocalBackend` over a Runtime whose model is a 1-layer, 64-wide random Llama with SmolLM2's
tokenizer: what remains of the CPU time is the host's work (DSL interpreter, program threads,
backend, tokenizer, request submission, scheduler, output streams). Beside it, the same prompts
go straight to `Runtime.generate` in one batch, as token ids and as text: the runtime's own host
cost per request, the floor of the DSL path.

Reported per path: programs (requests) per second, CPU seconds per program (this process, every
thread), requests per forward pass; and a cProfile of the DSL run over the threads it starts
(program workers, the batch pool, the main thread), top N by cumulative and by own time.

    python bench/dsl_overhead.py                       # 300 MMLU programs, cache on
    python bench/dsl_overhead.py --scale 50 --top 40 --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import programs  # noqa: E402
from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402

NEARLY_FREE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
                   eos_token_id=2, rms_norm_eps=1e-5, dtype="float32")
GEN_TOKENS = 4  # what programs.py's MMLU program decodes per question


class BatchSizes:
    """`Runtime.set_batch_hook`: requests per forward pass, and the largest pass."""

    def __init__(self) -> None:
        self.passes = 0
        self.requests = 0
        self.largest = 0

    def __call__(self, batch: Any) -> None:
        self.passes += 1
        self.requests += batch.size
        self.largest = max(self.largest, batch.size)

    def summary(self) -> dict[str, Any]:
        return {"forward_passes": self.passes, "largest_batch": self.largest,
                "mean_batch": self.requests / max(self.passes, 1)}


@contextmanager
def profiled_threads(profile: bool) -> Iterator[list[cProfile.Profile]]:
    """cProfile of the calling thread and of every thread started inside the block (Python
    profiles per thread: each new thread enables its own profiler as it starts), timed by each
    thread's CPU time: time spent waiting does not count. On leaving, the threads started inside
    are joined (briefly), so that their profiles are complete."""
    profiles: list[cProfile.Profile] = []
    if not profile:
        yield profiles
        return
    lock = threading.Lock()
    before = set(threading.enumerate())

    def start_in_thread(*_: Any) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(prof)
        prof.enable()

    main = cProfile.Profile(time.thread_time)
    profiles.append(main)
    threading.setprofile(start_in_thread)
    main.enable()
    try:
        yield profiles
    finally:
        main.disable()
        threading.setprofile(None)
        gc.collect()  # program states closed: their worker threads end
        deadline = time.monotonic() + 5.0
        for thread in set(threading.enumerate()) - before:
            thread.join(max(0.0, deadline - time.monotonic()))


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by thread name (Linux
    /proc; empty elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, name in names.items():
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def top_table(profiles: list[cProfile.Profile], sort: str, top: int) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=stream)
    for prof in profiles[1:]:
        try:
            stats.add(prof)
        except TypeError:  # a profiler that recorded nothing
            continue
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    return stream.getvalue()


def measure(label: str, runtime: Any, count: int, work: Callable[[], Any]) -> dict[str, Any]:
    if not runtime.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    sizes = BatchSizes()
    runtime.set_batch_hook(sizes)
    threads_start = thread_cpu_seconds()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    work()
    seconds = time.perf_counter() - wall_start
    cpu = time.process_time() - cpu_start
    threads_end = thread_cpu_seconds()
    runtime.set_batch_hook(None)
    # The runtime's own threads (scheduler, output): alive before and after.
    engine = sum(threads_end[name] - threads_start[name] for name in threads_end
                 if name.startswith("lmnb-") and name in threads_start)
    return {"path": label, "programs": count, "seconds": seconds, "cpu_seconds": cpu,
            "programs_per_s": count / seconds, "cpu_ms_per_program": 1e3 * cpu / count,
            "engine_threads_cpu_ms_per_program": 1e3 * engine / count,
            "other_cpu_ms_per_program": 1e3 * (cpu - engine) / count,
            **sizes.summary()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=25.0,
                        help="programs.py's MMLU scale: 12 programs per unit (default 300)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per path; the fastest counts")
    parser.add_argument("--top", type=int, default=30, help="rows of each profile table")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "dsl_overhead.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from lmnb.lang.backends.local import LocalBackend
    from lmnb.runtime.engine import Runtime
    from lmnb.runtime.models import loader

    hf_logging.set_verbosity_error()
    tokenizer_dir = loader.resolve_model_dir(args.tokenizer)
    with tempfile.TemporaryDirectory(prefix="lmnb-dsl-overhead-") as scratch:
        folder = Path(scratch) / "nearly-free"
        folder.mkdir()
        config = {**NEARLY_FREE, "vocab_size": len(loader.load_tokenizer(tokenizer_dir))}
        (folder / "config.json").write_text(json.dumps(config))
        runtime = Runtime(str(folder), tokenizer_path=str(tokenizer_dir), load_format="dummy",
                          device="cpu", dtype="float32", max_total_tokens=400_000,
                          max_running_requests=1024, context_length=4096,
                          disable_radix_cache=args.disable_radix_cache)
    try:
        return run(args, runtime, LocalBackend)
    finally:
        runtime.close()


def run(args: argparse.Namespace, runtime: Any, backend_type: type) -> dict[str, Any]:
    def dsl_job() -> Callable[[Any], int]:
        return programs.mmlu(random.Random(programs.SEED), args.scale)

    runtime.generate("Hello, world.", {"max_new_tokens": 2, "temperature": 0.0})
    # The prompts the DSL sends, as ids (recorded once): the raw paths send the same.
    recorder = programs.RecordingRuntime(runtime)
    count = dsl_job()(backend_type(recorder))
    recorded = [r.input_ids for r in recorder.requests if r.meta_info["completion_tokens"]]
    texts = [runtime.tokenizer.decode(ids, skip_special_tokens=True) for ids in recorded]
    params = {"max_new_tokens": GEN_TOKENS, "min_new_tokens": GEN_TOKENS, "temperature": 0.0}
    paths: dict[str, Callable[[], Any]] = {
        "dsl run_batch": lambda: dsl_job()(backend_type(runtime)),
        "dsl run_batch (programs.py recorder)": lambda: dsl_job()(backend_type(
            programs.RecordingRuntime(runtime))),
        "raw generate, ids": lambda: runtime.generate(input_ids=recorded,
                                                      sampling_params=params),
        "raw generate, text": lambda: runtime.generate(texts, params),
    }
    results: dict[str, dict[str, Any]] = {}
    for label, work in paths.items():
        runs = [measure(label, runtime, count if label.startswith("dsl") else len(recorded),
                        work) for _ in range(args.repeats)]
        results[label] = min(runs, key=lambda r: r["cpu_seconds"])
    profile: dict[str, str] = {}
    if not args.no_profile:
        runtime.flush_cache()
        with profiled_threads(True) as profiles:
            dsl_job()(backend_type(runtime))
        profile = {"cumulative": top_table(profiles, "cumulative", args.top),
                   "tottime": top_table(profiles, "tottime", args.top)}
    print(f"dsl_overhead: MMLU 5-shot, {count} programs ({len(recorded)} gens), nearly-free "
          f"model on the CPU, radix cache {'off' if args.disable_radix_cache else 'on'}")
    print(format_table(
        ["path", "programs", "seconds", "cpu s", "prog/s", "cpu ms/prog", "engine thr ms",
         "other ms", "fwd passes", "mean batch", "max batch"],
        [(r["path"], r["programs"], r["seconds"], r["cpu_seconds"], r["programs_per_s"],
          r["cpu_ms_per_program"], r["engine_threads_cpu_ms_per_program"],
          r["other_cpu_ms_per_program"], r["forward_passes"], r["mean_batch"],
          r["largest_batch"])
         for r in results.values()]))
    floor = results["raw generate, text"]["cpu_ms_per_program"]
    dsl = results["dsl run_batch"]["cpu_ms_per_program"]
    print(f"DSL CPU per program / raw text generate per request: {dsl / floor:.2f}x")
    for sort, table in profile.items():
        print(f"\n---- DSL run, profile by {sort} (threads the run started + main) ----")
        print(table)
    payload = {
        "benchmark": "dsl_overhead",
        "config": {"workload": "mmlu", "scale": args.scale, "programs": count,
                   "repeats": args.repeats, "model": NEARLY_FREE,
                   "radix_cache": not args.disable_radix_cache},
        "results": results,
        "dsl_over_raw_text_cpu": dsl / floor,
        "profile": profile,
        "environment": environment("cpu"),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
