"""Host time on the critical path at each EXTEND (prefill) pass transition.

The real scheduler and model runner (ForwardBatch, attention metadata, sampling) run a
shared-prefix workload (default: bench/vs_vllm.py's prefix-ids shape, 8 prefixes x 1,500 tokens
x 32 questions of 40 tokens) over the *null model* of bench/scheduler_overhead.py, so what is
timed is the engine's own host work. Per EXTEND pass N:

- `critical_ms`: from N's results being ready (its `result()` returned) to the next pass's
  launch, 0 when the next pass was launched before N's results were waited for: the time a
  device would sit idle between the passes (`critical_cpu_ms`: the scheduler thread's CPU time
  in that span, steadier on a busy machine);
- `between_launches_ms`: from N's launch returning to the next launch starting: the host work
  the device must cover with N's own work (hidden when shorter than N's device time).

On the CPU the "device" work (the batch's index tensors) runs inline and counts as host time;
torch runs on one thread. The default workload is small (8 prefixes x 200 tokens x 32 questions
of 16 tokens, 2,048-token passes) so that the per-request work dominates;
`--prefix-len 1500 --question-len 40 --chunk 8192` is vs_vllm's shape.

Modes: `sync` (no overlap), `overlap-decode` (overlap of decode passes only: the schedule before
prefill passes were pipelined), `overlap` (decode and prefill passes pipelined).

    python bench/extend_pipeline.py                    # CPU, JSON on stdout
    python bench/extend_pipeline.py --device cuda      # the same on a GPU (null model)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, resolve_device, write_json  # noqa: E402,I001
from bench.scheduler_overhead import NullModel, NullSink  # noqa: E402
from lmnb.runtime.config import EngineConfig, ModelConfig  # noqa: E402
from lmnb.runtime.core import ForwardMode, Req, SamplingParams  # noqa: E402
from lmnb.runtime.memory import KVAllocator  # noqa: E402
from lmnb.runtime.model_runner import ModelRunner  # noqa: E402
from lmnb.runtime.models import loader  # noqa: E402
from lmnb.runtime.policy import make_policy  # noqa: E402
from lmnb.runtime.radix.cache import RadixCache  # noqa: E402
from lmnb.runtime.scheduler import (  # noqa: E402
    CacheManager,
    ReqState,
    Scheduler,
    SchedulerConfig,
    StopRules,
)

MODES = ("sync", "overlap-decode", "overlap")


class TimedPending:
    def __init__(self, inner: Any, record: dict[str, Any]) -> None:
        self.inner, self.record = inner, record

    def result(self) -> Any:
        out = self.inner.result()
        self.record["ready"] = time.perf_counter()
        self.record["ready_cpu"] = time.thread_time()
        return out


class LaunchClock:
    """Wraps a runner's `launch`: per pass its mode, size, launch start/end, results ready."""

    def __init__(self, runner: ModelRunner, device: torch.device) -> None:
        self.inner = runner.launch
        self.device = device
        self.passes: list[dict[str, Any]] = []

    def __call__(self, batch: Any, rows: Any) -> TimedPending:
        record = {"mode": batch.mode, "requests": batch.size, "tokens": sum(batch.extend_lens),
                  "start": time.perf_counter(), "start_cpu": time.thread_time()}
        pending = self.inner(batch, rows)
        record["end"] = time.perf_counter()
        self.passes.append(record)
        return TimedPending(pending, record)


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(args.prefixes):
        prefix = torch.randint(100, vocab - 1, (args.prefix_len,), generator=rng).tolist()
        prompts += [prefix + torch.randint(100, vocab - 1, (args.question_len,),
                                           generator=rng).tolist()
                    for _ in range(args.questions)]
    return prompts


def run_mode(mode: str, args: argparse.Namespace, model_config: ModelConfig,
             device: torch.device) -> dict[str, Any]:
    prompts = workload(args, model_config.vocab_size)
    n = len(prompts)
    max_tokens = sum(len(p) for p in prompts) + n * (args.new_tokens + 8) + 64
    engine_config = EngineConfig(max_total_tokens=max_tokens, max_running_requests=n,
                                 context_length=args.prefix_len + args.question_len
                                 + args.new_tokens + 32)
    model = NullModel(model_config.hidden_size, model_config.vocab_size, n, device)
    model.hidden = torch.zeros(args.chunk, model_config.hidden_size, device=device)
    runner = ModelRunner(model, model_config, engine_config, device=device,
                         dtype=torch.float16 if device.type == "cuda" else torch.float32,
                         eos_token_ids={2})
    clock = LaunchClock(runner, device)
    runner.launch = clock  # type: ignore[method-assign]
    allocator = KVAllocator(runner.max_total_tokens, device)
    config = SchedulerConfig(chunked_prefill_size=args.chunk, overlap_schedule=mode != "sync")
    if hasattr(config, "overlap_extend"):  # absent before prefill passes were pipelined
        config.overlap_extend = mode == "overlap"
    scheduler = Scheduler(
        runner=runner, cache=CacheManager(RadixCache(allocator), allocator,
                                          runner.req_to_token_pool),
        policy=make_policy("lpm"), config=config, stop_rules=StopRules({2}),
        sink=NullSink())
    states = [ReqState(Req(origin_input_ids=p, sampling_params=SamplingParams(
        max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))) for p in prompts]
    start = time.perf_counter()
    for state in states:
        scheduler.add(state)
    while scheduler.step():
        pass
    end = time.perf_counter()
    wall = end - start
    assert all(len(s.req.output_ids) == args.new_tokens for s in states)
    passes = clock.passes
    transitions = []
    for current, following in zip(passes, passes[1:], strict=False):
        if current["mode"] is not ForwardMode.EXTEND:
            continue
        transitions.append({
            "requests": current["requests"], "tokens": current["tokens"],
            "next": following["mode"].value,
            "critical_ms": 1e3 * max(0.0, following["start"] - current["ready"]),
            "critical_cpu_ms": 1e3 * max(0.0, following["start_cpu"] - current["ready_cpu"]),
            "between_launches_ms": 1e3 * (following["start"] - current["end"])})
    critical = [t["critical_ms"] for t in transitions]
    critical_cpu = [t["critical_cpu_ms"] for t in transitions]
    return {"wall_s": wall, "passes": len(passes),
            "first_launch_ms": 1e3 * (passes[0]["start"] - start),
            "after_last_ms": 1e3 * (end - passes[-1]["ready"]),
            "extend_passes": sum(p["mode"] is ForwardMode.EXTEND for p in passes),
            "cached_tokens": sum(s.req.cached_tokens for s in states),
            "critical_ms_total": sum(critical),
            "critical_ms_median": statistics.median(critical) if critical else 0.0,
            "critical_cpu_ms_total": sum(critical_cpu),
            "transitions": transitions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=200)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=2048, help="chunked_prefill_size")
    parser.add_argument("--repeats", type=int, default=5, help="best (lowest CPU total) of")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    model_config = loader.load_model_config(loader.resolve_model_dir(None))
    results: dict[str, Any] = {"environment": environment(device), "args": vars(args)}
    for mode in args.modes.split(","):
        runs = [run_mode(mode, args, model_config, device) for _ in range(args.repeats)]
        results[mode] = min(runs, key=lambda r: r["critical_cpu_ms_total"])
    print(json.dumps(results, indent=1))
    write_json(RESULTS_DIR / f"extend_pipeline_{device.type}.json", results)
    return results


if __name__ == "__main__":
    main()
