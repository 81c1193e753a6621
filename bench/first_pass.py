"""Host time from `Runtime.generate` to the first forward pass, at bench/vs_vllm.py's sizes.

A tiny random-weight model (one layer, the Llama-3 vocabulary) on the CPU: what is measured is
lmnb's own Python between the call and the first pass (prompt checks, request states, output
registration, the scheduler's inbox, the radix match, the prefill plan, the batch and its
`ForwardBatch`), which does not depend on the model's size. The model's forward is replaced by
one that raises, so every pass fails at once and the `generate` call returns without decoding
(the runtime stays warm for the next repeat; the cache is flushed between repeats).

Timed per repeat (milliseconds from `generate`'s entry): the first `ModelRunner.launch` call's
start and its forward's start, and the time inside each instrumented step before then (calls on
the caller's thread, then the scheduler thread's). `--profile` adds a cProfile of both threads
over that window.

    python bench/first_pass.py                               # both workloads, 5 repeats
    python bench/first_pass.py --workloads prefix-ids --repeats 9 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.dummy_models import write_dummy_model  # noqa: E402
from bench.instrument import Call, Patches  # noqa: E402
from bench.vs_vllm import FULL, WORKLOADS, Requests, make_workload  # noqa: E402
from lmnb.runtime import engine as engine_module  # noqa: E402
from lmnb.runtime import model_runner, request_checks  # noqa: E402
from lmnb.runtime.output import processor  # noqa: E402
from lmnb.runtime.scheduler import cache_manager, kv_peak, loop, prefill, scheduler  # noqa: E402

MODEL = "tiny-llama-3"
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
# The GPU bench's defaults that shape the first pass: CUDA's prefill budget, a pool as large as
# an H200's for Llama-3-8B.
RUNTIME_OPTIONS = {"chunked_prefill_size": 8192, "max_total_tokens": 600_000}
CALLER_STEPS = (
    (engine_module, "split_prompts"), (request_checks, "params_list"),
    (request_checks, "logprob_requests"), (engine_module, "build_media_prompts"),
    (request_checks, "check_prompt"), (engine_module.Runtime, "_make_state"),
    (processor.OutputProcessor, "registration"), (processor.OutputProcessor, "register_many"),
    (loop.SchedulerThread, "submit_many"),
)
SCHEDULER_STEPS = (
    (scheduler.Scheduler, "add"), (scheduler.Scheduler, "_schedule_extend"),
    (prefill.PrefillManager, "plan"), (kv_peak.KVPeak, "add"), (kv_peak.KVPeak, "peak_with"),
    (cache_manager.CacheManager, "match"), (cache_manager.CacheManager, "bind"),
    (scheduler.Scheduler, "_make_batch"), (cache_manager.CacheManager, "extend_all"),
    (model_runner.ModelRunner, "forward_batch"),
)


class FirstForward(RuntimeError):
    """Raised in place of every forward pass: the run ends at its first."""


@dataclass
class Window:
    """Calls timed between `generate`'s entry and the first forward's start."""

    start: float = 0.0
    launch: float | None = None
    forward: float | None = None
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    profiles: list[cProfile.Profile] = field(default_factory=list)
    profile: bool = False

    @property
    def open(self) -> bool:
        return self.forward is None


def instrument(window: Window) -> Callable[[], None]:
    """Wraps the steps, `launch` and the forward; returns what undoes it."""
    patches = Patches()

    def timed(call: Call) -> None:
        if window.open:
            window.totals[call.label] += call.seconds
            window.counts[call.label] += 1

    def on_launch() -> None:
        if window.launch is None:
            window.launch = time.perf_counter()

    profiler = cProfile.Profile()

    def on_step_start() -> None:
        if window.profile and window.open and not window.profiles:
            window.profiles.append(profiler)
            profiler.enable()

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if window.forward is None:
            window.forward = time.perf_counter()
            if window.profiles:
                window.profiles[-1].disable()
        raise FirstForward("the bench stops every run at its first forward")

    for owner, name in (*CALLER_STEPS, *SCHEDULER_STEPS):
        patches.wrap(owner, name, timed)
    patches.wrap(loop.SchedulerThread, "_handle", timed, before=on_step_start)
    patches.wrap(model_runner.ModelRunner, "launch", timed, before=on_launch)
    patches.replace(model_runner.ModelRunner, "_forward", forward)
    return patches.undo


def measure(rt: Any, work: Requests, repeats: int, profile: bool) -> dict[str, Any]:
    params = [{"max_new_tokens": n, "ignore_eos": True, "temperature": work.temperature}
              for n in work.max_tokens]
    runs: list[dict[str, Any]] = []
    profiles: list[cProfile.Profile] = []
    for index in range(repeats + 1):  # the first warms up
        window = Window(profile=profile and index == repeats)
        restore = instrument(window)
        caller = cProfile.Profile() if window.profile else None
        try:
            window.start = time.perf_counter()
            if caller is not None:
                caller.enable()
            rt.generate(input_ids=work.prompts, sampling_params=params)
            if caller is not None:
                caller.disable()
        finally:
            restore()
        rt.flush_cache()
        if caller is not None:
            profiles = [caller, *window.profiles]
        if index == 0:
            continue
        assert window.launch is not None and window.forward is not None
        runs.append({
            "launch_ms": (window.launch - window.start) * 1e3,
            "forward_ms": (window.forward - window.start) * 1e3,
            "steps_ms": {name: total * 1e3 for name, total in window.totals.items()},
            "calls": dict(window.counts)})
    result: dict[str, Any] = {"workload": work.name, "label": work.label, "runs": runs}
    for key in ("launch_ms", "forward_ms"):
        values = [run[key] for run in runs]
        result[key] = {"median": statistics.median(values), "min": min(values)}
    names = list(runs[0]["steps_ms"])
    result["steps_ms"] = {name: {"median": statistics.median(r["steps_ms"].get(name, 0.0)
                                                             for r in runs),
                                 "min": min(r["steps_ms"].get(name, 0.0) for r in runs),
                                 "calls": runs[0]["calls"][name]} for name in names}
    if profiles:
        text = io.StringIO()
        for which, prof in zip(("caller thread", "scheduler thread"), profiles, strict=False):
            text.write(f"---- {which}\n")
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        result["profile"] = text.getvalue()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="offline,prefix-ids")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the last repeat's window (both threads)")
    parser.add_argument("--json-out", default=str(RESULTS_DIR / "first_pass.json"))
    args = parser.parse_args()
    names = [name for name in args.workloads.split(",") if name]
    unknown = [name for name in names if name not in WORKLOADS or name.startswith("decode")]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}")
    logging.getLogger("lmnb").setLevel(logging.CRITICAL)  # every pass fails, on purpose
    from lmnb.runtime.engine import Runtime

    with tempfile.TemporaryDirectory() as root:
        model = write_dummy_model(MODEL, root)
        config = model.path / "config.json"
        config.write_text(json.dumps({**model.fields, **SHRINK}))
        rt = Runtime(model.path, device="cpu", **model.runtime_options(), **RUNTIME_OPTIONS)
        try:
            results = []
            for name in names:
                work = make_workload(name, FULL, model.fields["vocab_size"])
                assert isinstance(work, Requests)
                results.append(measure(rt, work, args.repeats, args.profile))
        finally:
            rt.close()
    for result in results:
        print(f"\n{result['workload']} ({result['label']}): ms from generate() entry")
        rows = [["first launch", result["launch_ms"]["median"], result["launch_ms"]["min"], ""],
                ["first forward", result["forward_ms"]["median"], result["forward_ms"]["min"],
                 ""]]
        rows += [[f"  in {name}", s["median"], s["min"], s["calls"]]
                 for name, s in result["steps_ms"].items()]
        print(format_table(["", "median", "min", "calls"], rows))
        if "profile" in result:
            print(result["profile"])
    path = write_json(args.json_out, {"environment": environment("cpu"),
                                      "config": {"repeats": args.repeats,
                                                 "runtime": RUNTIME_OPTIONS, "model": SHRINK},
                                      "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
