"""Host timeline of every forward pass of one bench/vs_vllm.py workload, lmnb alone: where the
scheduler thread's time goes between passes, and whether the device waits for the host.

The engine, the model folder (random weights of a real architecture, the real tokenizer) and the
workload are vs_vllm.py's. The scheduler's calls are wrapped at class level (bench/instrument.py):
the plan (`Scheduler._schedule_extend`, `_schedule_decode`, the overlap schedule's
`_following_extend`, `_following_decode`, `_decode_after_prefill`), `ModelRunner.launch`,
`PendingStep.result` (the wait for the pass's results), `Scheduler._complete` (outputs, stop rules,
KV to the cache), and the loop's `Scheduler.step`, `SchedulerThread._drain` / `_handle`. Each run
(the prefix cache emptied before it) is one `generate` call; the first warms up and is not
reported. Per pass: its mode, requests, new and cached-prefix tokens, when it was launched (ms
after `generate` was called), the gap since the previous launch returned, plan, plan-to-launch,
launch, in flight (from the launch's return to the wait for its results; the overlap schedule
plans and launches the next pass meanwhile), wait and complete times. Per run: the wall time, the
time before the first launch, and the loop's totals.

`--profile`: the last run under torch.profiler: kernel time by category and the top kernels
(bench/kernel_profile.py), and the Triton extend kernel's time in each EXTEND pass (its kernels
are one per layer a pass, in launch order). The profiler's overhead is in that run's host times.

`--extend-capture` (CUDA, Triton backend): in the last run, layer 0's extend-attention inputs of
each EXTEND pass (up to `--capture-passes`) are kept, and after the run the Triton extend kernel
alone is timed on them (bench/decode_kernel.py's `time_kernel`) with lmnb's tile config and
others, over the whole KV pool or a compact copy of the slots the pass reads, with int64 and int32
index metadata. The K/V buffers are the pool's own, not copies: the kernel reads whatever they hold
by then, which does not change its time.

Output: the last run's per-pass table, a line per run, bench/results/pass_timeline.json
(`--output`; on the GPU machine pass `--output $OUT/pass_timeline.json` to get it back).

GPU machine (Llama-3-8B random weights, the Llama-3 tokenizer from .gpu/tokenizer-llama3, see
bench/fetch_tokenizers.sh):
    python bench/pass_timeline.py --device cuda --profile
    python bench/pass_timeline.py --device cuda --extend-capture
    python bench/pass_timeline.py --device cuda --workload offline --runs 2
CPU check (a tiny random Llama-3-shaped model, the embedded SmolLM2 tokenizer, TINY sizes):
    python bench/pass_timeline.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    synchronize,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402
from bench.instrument import Call, Patches  # noqa: E402
from bench.kernel_profile import KernelEvent, device_events, summarize  # noqa: E402
from bench.vs_vllm import (  # noqa: E402
    DEFAULT_TOKENIZER_DIR,
    FULL,
    TINY,
    TINY_MODEL,
    WORKLOADS,
    LmnbEngine,
    Requests,
    Workload,
    empty_cache,
    make_workload,
    model_workloads,
    prepare_model,
    print_profile,
    tokenizer_size,
)
from lmnb.runtime import model_runner  # noqa: E402
from lmnb.runtime.scheduler import loop, scheduler  # noqa: E402

if TYPE_CHECKING:
    from lmnb.runtime.kernels.triton_extend import ExtendConfig

DEFAULT_MODEL = "llama-3-8b"
EXTEND_KERNEL = "_extend_kernel"  # triton_extend.py's kernel, as the profiler names it
PLANS = ("_schedule_extend", "_schedule_decode", "_following_extend", "_following_decode",
         "_decode_after_prefill")
LOOP_CALLS = ((scheduler.Scheduler, "step"), (loop.SchedulerThread, "_drain"),
              (loop.SchedulerThread, "_handle"))
# Extend tiles timed beside lmnb's own choice (triton_extend.ExtendConfig fields).
CAPTURE_TILES: dict[str, tuple[int, int, int, int, bool]] = {
    "m64 n32 w4 s3 k_rows": (64, 32, 4, 3, True), "m128 n32 w8 s3": (128, 32, 8, 3, False)}
TABLE_HEADERS = ["pass", "mode", "reqs", "new tok", "prefix tok", "at ms", "gap ms", "plan ms",
                 "plan>launch", "launch ms", "in flight", "wait ms", "complete ms"]

Span = tuple[float, float]  # perf_counter stamps: (start, end)


def _ms(span: Span | None) -> float | None:
    return None if span is None else (span[1] - span[0]) * 1e3


@dataclass
class Pass:
    """One launched forward pass and the scheduler thread's calls that handled it."""

    mode: str
    requests: int
    new_tokens: int
    prefix_tokens: int
    launch: Span
    plan: Span | None = None
    wait: Span | None = None
    complete: Span | None = None
    extend_kernel_ms: float | None = None


class PassTimeline:
    """The scheduler thread's calls during one run, as one `Pass` per launch (plan -> launch ->
    wait for the results -> complete), matched by the batch and the pending step they handle,
    and the loop's calls. Recorded on the scheduler thread; read once a run has ended."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Forgets the last run; the next starts now."""
        self.start = time.perf_counter()
        self.passes: list[Pass] = []
        self.loop_calls: list[tuple[str, Span]] = []
        self._plans: dict[int, Span] = {}  # id(batch) -> the plan call that returned it
        self._by_batch: dict[int, Pass] = {}
        self._by_pending: dict[int, Pass] = {}

    def install(self, patches: Patches) -> None:
        for name in PLANS:
            patches.wrap(scheduler.Scheduler, name, self._planned)
        patches.wrap(model_runner.ModelRunner, "launch", self._launched)
        patches.wrap(model_runner.PendingStep, "result", self._waited)
        patches.wrap(scheduler.Scheduler, "_complete", self._completed)
        for owner, name in LOOP_CALLS:
            patches.wrap(owner, name, self._looped)

    def _planned(self, call: Call) -> None:
        if call.result is not None:  # a plan calling another ends last: the outer one is kept
            batch, _ = call.result
            self._plans[id(batch)] = (call.start, call.end)

    def _launched(self, call: Call) -> None:
        if call.result is None:  # it raised: no pass
            return
        batch = call.args[1]
        entry = Pass(mode=batch.mode.name, requests=batch.size,
                     new_tokens=sum(batch.extend_lens), prefix_tokens=sum(batch.prefix_lens),
                     launch=(call.start, call.end), plan=self._plans.pop(id(batch), None))
        self.passes.append(entry)
        self._by_batch[id(batch)] = entry
        self._by_pending[id(call.result)] = entry

    def _waited(self, call: Call) -> None:
        entry = self._by_pending.pop(id(call.args[0]), None)
        if entry is not None:
            entry.wait = (call.start, call.end)

    def _completed(self, call: Call) -> None:
        entry = self._by_batch.pop(id(call.args[1]), None)
        if entry is not None:
            entry.complete = (call.start, call.end)

    def _looped(self, call: Call) -> None:
        self.loop_calls.append((call.label, (call.start, call.end)))

    def report(self, end: float) -> dict[str, Any]:
        """The run that started at `restart()` and ended at `end`: per pass its times (ms after
        the start, durations in ms) and the loop's totals within the run."""
        def at(stamp: float) -> float:
            return (stamp - self.start) * 1e3

        rows = []
        previous_end = self.start
        for index, entry in enumerate(self.passes):
            launch_start, launch_end = entry.launch
            overlapped = bool(index and self.passes[index - 1].wait is not None
                              and launch_start < self.passes[index - 1].wait[0])
            rows.append({
                "index": index, "mode": entry.mode, "requests": entry.requests,
                "new_tokens": entry.new_tokens, "prefix_tokens": entry.prefix_tokens,
                "launch_at_ms": at(launch_start),
                "gap_ms": (launch_start - previous_end) * 1e3,
                "plan_ms": _ms(entry.plan),
                "plan_to_launch_ms": (None if entry.plan is None
                                      else (launch_start - entry.plan[1]) * 1e3),
                "launch_ms": _ms(entry.launch),
                "in_flight_ms": None if entry.wait is None else (entry.wait[0] - launch_end) * 1e3,
                "wait_ms": _ms(entry.wait), "complete_ms": _ms(entry.complete),
                "completed_at_ms": None if entry.complete is None else at(entry.complete[1]),
                "overlapped": overlapped, "extend_kernel_ms": entry.extend_kernel_ms})
            previous_end = launch_end
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for label, (start, stop) in self.loop_calls:
            if self.start <= start <= end:
                totals[label] += (min(stop, end) - start) * 1e3
                counts[label] += 1
        plans = [entry.plan[0] for entry in self.passes if entry.plan is not None]
        return {"wall_ms": (end - self.start) * 1e3,
                "first_plan_ms": at(min(plans)) if plans else None,
                "first_launch_ms": rows[0]["launch_at_ms"] if rows else None,
                "passes": rows, "loop_ms": dict(totals), "loop_calls": dict(counts)}


def table_rows(passes: Sequence[dict[str, Any]], *, kernels: bool) -> list[list[Any]]:
    """`TABLE_HEADERS` (and the extend kernel's ms with `kernels`) of each pass."""
    keys = ("new_tokens", "prefix_tokens", "launch_at_ms", "gap_ms", "plan_ms",
            "plan_to_launch_ms", "launch_ms", "in_flight_ms", "wait_ms", "complete_ms",
            *(("extend_kernel_ms",) if kernels else ()))
    return [[str(p["index"]), p["mode"] + ("*" if p["overlapped"] else ""), p["requests"],
             *(p[k] for k in keys)] for p in passes]


# ---- --profile ----------------------------------------------------------------------------------
def attribute_extend_kernels(events: Sequence[KernelEvent], passes: Sequence[Pass],
                             layers: int) -> str | None:
    """Sets each EXTEND pass's `extend_kernel_ms` from the extend kernels (one per layer a pass,
    in launch order); a note instead when their count does not match."""
    kernels = sorted((e for e in events if e.name == EXTEND_KERNEL), key=lambda e: e.start_us)
    extend = [entry for entry in passes if entry.mode == "EXTEND"]
    if len(kernels) != layers * len(extend):
        return (f"{len(kernels)} {EXTEND_KERNEL} kernels for {len(extend)} EXTEND passes of "
                f"{layers} layers: not attributed to passes")
    for i, entry in enumerate(extend):
        entry.extend_kernel_ms = sum(k.duration_us for k in kernels[i * layers:(i + 1) * layers]
                                     ) / 1e3
    return None


def print_top_kernels(summary: dict[str, Any]) -> None:
    print(format_table(["kernel", "calls", "ms", "category"],
                       [[k["name"][:100], k["count"], 1e3 * k["seconds"], k["category"]]
                        for k in summary["top_kernels"]]))


# ---- --extend-capture ---------------------------------------------------------------------------
@dataclass
class Captured:
    """Layer 0's `extend_attention` inputs of one EXTEND pass."""

    pass_index: int
    q: torch.Tensor
    k: torch.Tensor  # the pool's layer buffers themselves
    v: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_extend_len: int
    scale: float
    config: ExtendConfig | None
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class ExtendCapture:
    """Keeps the first `extend_attention` call's inputs of each pass the timeline sees launched
    (layer 0's), while `on`, up to `limit` passes."""

    timeline: PassTimeline
    limit: int
    on: bool = False
    captured: list[Captured] = field(default_factory=list)

    def install(self, patches: Patches) -> None:
        from lmnb.runtime.kernels import triton_backend

        patches.wrap(triton_backend, "extend_attention", self._extended)

    def _extended(self, call: Call) -> None:
        index = len(self.timeline.passes)  # the pass being launched
        if (not self.on or len(self.captured) >= self.limit
                or (self.captured and self.captured[-1].pass_index == index)):
            return
        q, k, v, _out, qo_indptr, kv_indptr, kv_indices = call.args[:7]
        kw = call.kwargs
        self.captured.append(Captured(
            pass_index=index, q=q.clone(), k=k, v=v, qo_indptr=qo_indptr.clone(),
            kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
            max_extend_len=kw["max_extend_len"], scale=kw["scale"], config=kw.get("config"),
            kv_scales=kw.get("kv_scales")))


def time_captured(capture: Captured) -> dict[str, Any]:
    """The extend kernel alone on one captured pass: µs per config (lmnb's and
    `CAPTURE_TILES`) and layout (the whole pool or a compact copy of the slots read, int64 or
    int32 index metadata where the buffer's offsets fit in 32 bits)."""
    from bench.decode_kernel import time_kernel
    from lmnb.runtime.kernels import triton_extend
    from lmnb.runtime.kernels.triton_backend import kernel_index_dtype

    c = capture
    qo, kv = c.qo_indptr.tolist(), c.kv_indptr.tolist()
    new = [b - a for a, b in zip(qo, qo[1:], strict=False)]
    seqs = [b - a for a, b in zip(kv, kv[1:], strict=False)]
    slots, inverse = torch.unique(c.kv_indices, return_inverse=True)
    compact_scales = None if c.kv_scales is None else tuple(s[slots] for s in c.kv_scales)
    layouts = {"pool": (c.k, c.v, c.kv_indices, c.kv_scales),
               "compact": (c.k[slots].contiguous(), c.v[slots].contiguous(), inverse,
                           compact_scales)}
    configs: dict[str, ExtendConfig | None] = {"lmnb": c.config}
    for name, tile in CAPTURE_TILES.items():
        configs[name] = triton_extend.ExtendConfig(*tile)
    out = torch.empty_like(c.q)
    timings: dict[str, dict[str, float]] = {}
    for layout, (k, v, indices, scales) in layouts.items():
        dtypes = [torch.int64] + ([torch.int32] if kernel_index_dtype(k.numel()) is torch.int32
                                  else [])
        for dtype in dtypes:
            metadata = tuple(t.to(dtype) for t in (c.qo_indptr, c.kv_indptr, indices))
            column = timings.setdefault(f"{layout} {str(dtype).removeprefix('torch.')}", {})
            for name, config in configs.items():
                def run(k: torch.Tensor = k, v: torch.Tensor = v, metadata: tuple = metadata,
                        config: ExtendConfig | None = config,
                        scales: tuple[torch.Tensor, ...] | None = scales) -> torch.Tensor:
                    return triton_extend.extend_attention(
                        c.q, k, v, out, *metadata, max_extend_len=c.max_extend_len,
                        scale=c.scale, config=config, kv_scales=scales)
                column[name] = 1e3 * time_kernel(run)
    return {"pass": c.pass_index, "requests": len(new), "new_tokens": sum(new),
            "max_new_tokens": max(new, default=0),
            "prefix_lens": sorted({s - n for s, n in zip(seqs, new, strict=True)})[:8],
            "index_dtype": str(c.kv_indices.dtype).removeprefix("torch."),
            "pool_slots": c.k.shape[0], "slots_read": slots.numel(),
            "lmnb_config": None if c.config is None else c.config._asdict(),
            "us": timings}


def print_captured(results: Sequence[dict[str, Any]]) -> None:
    for r in results:
        print(f"\npass {r['pass']}: {r['requests']} requests, {r['new_tokens']:,} new tokens "
              f"(max {r['max_new_tokens']}), prefix lens {r['prefix_lens']}, {r['index_dtype']} "
              f"metadata, {r['slots_read']:,} of {r['pool_slots']:,} pool slots read; lmnb's "
              f"tile {r['lmnb_config']}")
        layouts = list(r["us"])
        names = list(r["us"][layouts[0]])
        print(format_table(["extend kernel, µs", *layouts],
                           [[name, *(r["us"][layout][name] for layout in layouts)]
                            for name in names]))


# ---- runs ---------------------------------------------------------------------------------------
def requests_of(work: Workload) -> tuple[list[Any], list[int], float]:
    """(prompts, output lengths, temperature): a decode workload runs its longer length."""
    if isinstance(work, Requests):
        return list(work.prompts), list(work.max_tokens), work.temperature
    return list(work.prompts), [work.first + work.steps] * len(work.prompts), 0.0


@contextlib.contextmanager
def maybe_profiled(on: bool, device: torch.device) -> Iterator[Any]:
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        yield prof


def measure(engine: LmnbEngine, work: Workload, *, runs: int, device: torch.device,
            layers: int, profile: bool, capture_passes: int | None) -> dict[str, Any]:
    """`runs` runs of `work` (the first a warm-up); each reported run's timeline, the last one's
    kernel profile and extend captures when asked."""
    prepared = engine.prepare(*requests_of(work))
    timeline = PassTimeline()
    capture = None if capture_passes is None else ExtendCapture(timeline, capture_passes)
    result: dict[str, Any] = {"runs": []}
    with Patches() as patches:
        timeline.install(patches)
        if capture is not None:
            capture.install(patches)
        for index in range(runs):
            last = index == runs - 1
            empty_cache(engine)
            before = engine.forward_passes()
            synchronize(device)
            if capture is not None:
                capture.on = last
            with maybe_profiled(profile and last, device) as prof:
                timeline.restart()
                counts = engine.run(prepared)
                end = time.perf_counter()
            passes = engine.forward_passes() - before  # on the scheduler thread: its step ended
            if prof is not None:
                events = device_events(prof)
                note = attribute_extend_kernels(events, timeline.passes, layers)
                result["profile"] = {
                    **summarize(events, wall_seconds=end - timeline.start, passes=passes,
                                top=25), "extend_kernel_note": note}
            if index == 0:
                continue
            result["runs"].append({**timeline.report(end), "forward_passes": passes,
                                   "counts": asdict(counts)})
    if capture is not None:
        result["extend_capture"] = [time_captured(c) for c in capture.captured]
    return result


def print_report(work: Workload, result: dict[str, Any]) -> None:
    last = result["runs"][-1]
    kernels = "profile" in result
    headers = TABLE_HEADERS + (["extend kernel ms"] if kernels else [])
    rows = table_rows(last["passes"], kernels=kernels)
    print(f"\n{work.label}: the last run's passes (ms; * launched before the previous pass's "
          "results were waited for)")
    print(format_table(headers, rows))
    for number, run in enumerate(result["runs"], 1):
        loop_ms = ", ".join(f"{label} {ms:.1f} ms ({run['loop_calls'][label]})"
                            for label, ms in run["loop_ms"].items())
        first = run["first_launch_ms"]
        print(f"run {number}: wall {run['wall_ms']:.1f} ms, {run['forward_passes']} passes, "
              f"first launch at {first if first is None else round(first, 2)} ms; {loop_ms}")
    if "profile" in result:
        summary = result["profile"]
        print_profile(f"the last run of {work.label}", summary,
                      "profiled: its host times include the profiler's")
        print_top_kernels(summary)
        if summary["extend_kernel_note"]:
            print(f"note: {summary['extend_kernel_note']}")
    if "extend_capture" in result:
        print_captured(result["extend_capture"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    parser.add_argument("--workload", default="prefix-ids", choices=WORKLOADS,
                        help="a bench/vs_vllm.py workload (default prefix-ids)")
    parser.add_argument("--model", default=None, choices=sorted(DUMMY_CONFIGS),
                        help=f"a bench/dummy_models.py architecture (default {DEFAULT_MODEL}; "
                             f"--tiny: {TINY_MODEL})")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="HF tokenizer folder copied into the model folder (default "
                             ".gpu/tokenizer-llama3; --tiny: the embedded SmolLM2's)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"CPU check: the {TINY_MODEL} architecture and TINY sizes")
    parser.add_argument("--runs", type=int, default=3,
                        help="generate calls, the first a warm-up (not reported)")
    parser.add_argument("--backend", default=None,
                        help="attention backend (default: triton on CUDA, lmnb's on a CPU)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="chunked_prefill_size (default: lmnb's)")
    parser.add_argument("--profile", action="store_true",
                        help="the last run under torch.profiler: kernel table, extend kernel "
                             "per pass")
    parser.add_argument("--extend-capture", action="store_true",
                        help="time the Triton extend kernel alone on the last run's passes "
                             "(CUDA, triton backend)")
    parser.add_argument("--capture-passes", type=int, default=8,
                        help="EXTEND passes captured at most (default 8)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "pass_timeline.json")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be >= 2 (the first is a warm-up)")
    if args.capture_passes < 1:
        parser.error("--capture-passes must be >= 1")
    args.device = resolve_device(args.device)
    args.model = args.model or (TINY_MODEL if args.tiny else DEFAULT_MODEL)
    if args.backend is None and args.device.type == "cuda":
        args.backend = "triton"
    if args.extend_capture and (args.device.type != "cuda" or args.backend != "triton"):
        parser.error("--extend-capture times the compiled Triton extend kernel: it needs "
                     "--device cuda and --backend triton (on a CPU it would run in Triton's "
                     "interpreter, whose times mean nothing)")
    args.sizes = TINY if args.tiny else FULL
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    fields = DUMMY_CONFIGS[args.model]
    with tempfile.TemporaryDirectory(prefix="lmnb-pass-timeline-") as scratch:
        if args.tokenizer_dir is not None:
            tokenizer_dir = args.tokenizer_dir
        elif args.tiny:
            from lmnb.runtime.models import loader

            tokenizer_dir = loader.resolve_model_dir(None)
        else:
            tokenizer_dir = DEFAULT_TOKENIZER_DIR
        try:
            model_dir = prepare_model(args.model, Path(scratch), tokenizer_dir)
        except FileNotFoundError as error:
            raise SystemExit(f"{error}: run bench/fetch_tokenizers.sh (the Llama-3 tokenizer "
                             "into .gpu/tokenizer-llama3) or pass --tokenizer-dir") from error
        if args.workload == "prefix-text":
            _, notes = model_workloads(args.model, [args.workload], fields["vocab_size"],
                                       tokenizer_size(tokenizer_dir))
            if notes:
                raise SystemExit(notes[0])
        work = make_workload(args.workload, args.sizes, fields["vocab_size"])
        engine = LmnbEngine(model_dir, dtype=fields["dtype"], device=str(args.device),
                            backend=args.backend, mem_fraction=None, chunk=args.chunk)
        try:
            info = engine.info()
            result = measure(engine, work, runs=args.runs, device=args.device,
                             layers=fields["num_hidden_layers"], profile=args.profile,
                             capture_passes=args.capture_passes if args.extend_capture else None)
        finally:
            engine.close()
    print_report(work, result)
    payload = {"benchmark": "pass_timeline", "environment": environment(args.device),
               "config": {"workload": args.workload, "label": work.label, "model": args.model,
                          "dtype": fields["dtype"], "backend": args.backend, "tiny": args.tiny,
                          "runs": args.runs, "chunk": args.chunk, "profile": args.profile,
                          "extend_capture": args.extend_capture, "sizes": asdict(args.sizes)},
               "info": info, **result}
    path = write_json(args.output, payload)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
