"""The host cost of the DSL path per program (one `gen` each), beside the same requests sent raw.

`bench/programs.py`'s MMLU workload (its own builders and programs; the data is built before the
clock starts) runs through `run_batch` on a `LocalBackend`: every program is a task on the program
loop, its gen submitted straight into the runtime. Beside it, the same prompts go straight to
`Runtime.generate` in one batch, as token ids and as text: the runtime's own host cost per
request, the floor of the DSL path; and the DSL path once more with each gen sent to the
scheduler as its program submits it ("unbatched submits": no `batched_submits` hold), to show
what holding a loop iteration's gens buys. By default the model is a 1-layer, 64-wide random
Llama with SmolLM2's tokenizer on the CPU, which costs nearly nothing: what remains is the host's
work (interpreter, backend, tokenizer, request submission, scheduler, output streams). On a GPU,
give a real architecture with random weights (`--dummy-config llama-3-8b --device cuda`) or a model
folder (`--model`): the wall-time ratio is then the one that users see.

Reported per path: programs (requests) per second, CPU seconds per program (this process, every
thread), requests per forward pass; the DSL's CPU and wall time over the raw text path's; how the
requests reached the scheduler (`pass_comparison`: forward and extend passes, requests and tokens
per extend pass, when the first pass and the last extend pass ended, the time after the last pass,
garbage-collection pauses), for the DSL path beside both raw paths; a request timeline per path
(`bench/request_timeline.py`: when the first program body ran, the first gen was submitted, the
first requests reached `Runtime.generate`, the scheduler's inbox and its waiting queue, when the
first pass was launched and ended, and each thread's CPU time until then); and a cProfile of the
DSL run (per thread before Python 3.12: the main thread, the program loop, threads started
during it; from 3.12 one profile of every thread), top N by cumulative and by own time.
`--gc-freeze` freezes the startup heap first (full collections then skip the model's objects),
to tell GC pauses from the DSL's own cost. `--compare-switch-interval S` runs the DSL and raw
text paths once more with the GIL switch interval S: if the DSL's first pass then ends as early
as the raw path's, the scheduler thread was starved of the GIL while the program loop ran
program bodies (`--layers 32` gives the nearly-free model a real model's number of GIL
hand-overs per pass launch, to try this on the CPU). A `run_batch` shortens the switch interval
itself while it starts its programs (`lmnb.lang.gil_share`): `--batch-switch-interval` sets that
value (`none`: Python's own), `--compare-batch-switch-intervals 2e-5,none` runs the DSL path
once more with each. `--overlap` runs the overlap schedule (pipelined pass launches, on by
default on CUDA) on the CPU too. A `run_batch` starts its programs together and sends their first
gens to the scheduler in one hand-over (`global_config.batch_wave` None), after a lead wave of
a few programs spread over the batch (`--batch-lead-wave`, `--compare-batch-lead-waves none`),
or in growing waves: `--batch-wave`, `--compare-batch-waves 8`. `loop ms` is the program loop's
CPU per program (`time.thread_time` read on that thread before and after the path).
`--gil-probe`: a thread sleeping 0.2 ms at a time notes how late it wakes in each path (how long
a thread that gives the GIL up, as the scheduler at each torch call, waits to get it back).

    python bench/dsl_overhead.py                       # 300 MMLU programs, cache on, CPU
    python bench/dsl_overhead.py --scale 50 --top 40 --no-profile
    python bench/dsl_overhead.py --no-profile --switch-interval 1e-6   # the GPU's arrival order
    python bench/dsl_overhead.py --dummy-config llama-3-8b --device cuda --scale 22 --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmnb  # noqa: E402
from bench import programs  # noqa: E402
from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from bench.request_timeline import (  # noqa: E402
    STEPS,
    GilProbe,
    RequestTimeline,
    thread_cpu_seconds,
    timeline_rows,
)

NEARLY_FREE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                   intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
                   eos_token_id=2, rms_norm_eps=1e-5, dtype="float32")
GEN_TOKENS = 4  # what programs.py's MMLU program decodes per question
PREFIX_GEN_TOKENS = 16  # the shared-prefix workload's answer


@lmnb.function
def shared_prefix_question(s: Any, prefix: str, question: str) -> None:
    s += prefix + question + lmnb.gen("answer", max_tokens=PREFIX_GEN_TOKENS,
                                      min_tokens=PREFIX_GEN_TOKENS)


def shared_prefix(rng: random.Random, prefixes: int, questions: int) -> Callable[[Any], int]:
    """Issue 21's headline workload (bench/vs_vllm.py's shape): `prefixes` few-shot prefixes of
    1,400 words, `questions` short questions under each, one 16-token gen per program."""
    items = []
    for p in range(prefixes):
        prefix = f"Task {p}. " + " ".join(rng.choice(programs.WORDS) for _ in range(1400)) + "\n"
        items += [{"prefix": prefix, "question": "Q: " + " ".join(
            rng.choice(programs.WORDS) for _ in range(12)) + "?\nA:"} for _ in range(questions)]

    def job(backend: Any) -> int:
        states = shared_prefix_question.run_batch(items, backend=backend, progress_bar=False,
                                                  temperature=0.0)
        for state in states:
            if (error := state.error()) is not None:
                raise error
        return len(states)

    return job
PROGRAM_THREADS = ("lmnb-programs",)  # the DSL's (the program loop), not the engine's


class PassLog:
    """`Runtime.set_batch_hook`: every forward pass of a path (when it ended, seconds after the
    path started; its mode, requests and new tokens), to compare how the requests of each path
    reached the scheduler: how many passes, how many requests and tokens the extend passes held,
    and when the first one ended."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.passes: list[tuple[float, str, int, int]] = []  # (end s, mode, requests, tokens)

    def __call__(self, batch: Any) -> None:
        self.passes.append((time.perf_counter() - self.start, batch.mode.name, batch.size,
                            sum(batch.extend_lens)))

    def summary(self) -> dict[str, Any]:
        sizes = [size for _, _, size, _ in self.passes]
        extends = [(end, size, tokens) for end, mode, size, tokens in self.passes
                   if mode == "EXTEND"]
        return {"forward_passes": len(self.passes), "largest_batch": max(sizes, default=0),
                "mean_batch": sum(sizes) / max(len(sizes), 1),
                "extend_passes": len(extends),
                "requests_per_extend_pass": [size for _, size, _ in extends],
                "tokens_per_extend_pass": [tokens for _, _, tokens in extends],
                "first_pass_end_s": self.passes[0][0] if self.passes else None,
                "last_extend_end_s": extends[-1][0] if extends else None,
                "last_pass_end_s": self.passes[-1][0] if self.passes else None}


class GcPauses:
    """Garbage collections during a path, per generation, and the seconds the full (gen-2) ones
    took (with when each began, seconds after `start`): a full collection of a process holding
    a model's Python objects stops every thread."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.full_seconds = 0.0
        self.full_at: list[float] = []
        self.start = time.perf_counter()
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            self.counts[generation] += 1
            self._started = time.perf_counter()
            if generation == 2:
                self.full_at.append(round(self._started - self.start, 4))
        elif generation == 2:
            self.full_seconds += time.perf_counter() - self._started

    @contextmanager
    def watching(self) -> Iterator[GcPauses]:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


class UnbatchedSubmits:
    """A runtime whose `batched_submits` holds nothing: each gen of the program loop reaches the
    scheduler as soon as its program submits it (the DSL path before batched submissions)."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def batched_submits(self) -> AbstractContextManager[None]:
        return nullcontext()


def _on_program_loop(action: Callable[[], Any]) -> None:
    """Runs `action` on the program loop's thread and waits for it."""
    from lmnb.lang.event_loop import program_loop

    done = threading.Event()
    program_loop().call_soon_threadsafe(lambda: (action(), done.set()))
    done.wait()


def program_loop_cpu_seconds() -> float:
    """The program loop thread's CPU time so far (`time.thread_time` read on that thread: ns
    steps, where /proc's per-thread ticks are 10 ms)."""
    seconds: list[float] = []
    _on_program_loop(lambda: seconds.append(time.thread_time()))
    return seconds[0]


# Python 3.12's cProfile runs on `sys.monitoring`, which is process-wide: one profile may be
# enabled at a time, and it sees every thread's calls.
ONE_PROFILE_FOR_ALL_THREADS = sys.version_info >= (3, 12)


@contextmanager
def profiled_threads(profile: bool, *, all_threads_at_once: bool = ONE_PROFILE_FOR_ALL_THREADS
                     ) -> Iterator[list[cProfile.Profile]]:
    """cProfile of the calling thread, the program loop, and every thread started inside the
    block. Before Python 3.12 a profile is per thread: each thread gets its own (new threads
    enable theirs as they start), timed by its CPU time, so time spent waiting does not count.
    From 3.12 (`all_threads_at_once`) one profile sees every thread, timed by the wall clock:
    call counts and own times hold, but a caller's cumulative time may include other threads'
    calls made while it was on the (shared) stack. On leaving, the threads started inside are
    joined (briefly), so that their profiles are complete."""
    profiles: list[cProfile.Profile] = []
    if not profile:
        yield profiles
        return
    before = set(threading.enumerate())
    if all_threads_at_once:
        shared = cProfile.Profile()
        profiles.append(shared)
        shared.enable()
        try:
            yield profiles
        finally:
            shared.disable()
            _join_started(before)
        return
    loop_profile = cProfile.Profile(time.thread_time)
    profiles.append(loop_profile)
    _on_program_loop(loop_profile.enable)
    lock = threading.Lock()

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
        _on_program_loop(loop_profile.disable)
        threading.setprofile(None)
        _join_started(before)


def _join_started(before: set[threading.Thread]) -> None:
    gc.collect()  # program states closed: their worker threads end
    deadline = time.monotonic() + 5.0
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))


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


def measure(label: str, runtime: Any, count: int, work: Callable[[], Any], *,
            timeline: bool = True, gil_probe: bool = False) -> dict[str, Any]:
    if not runtime.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    passes = PassLog()
    steps = RequestTimeline()
    runtime.set_batch_hook(steps.batch_hook(passes) if timeline else passes)
    threads_start = thread_cpu_seconds()
    loop_start = program_loop_cpu_seconds()
    pauses = GcPauses()
    recording = steps.recording() if timeline else nullcontext(steps)
    probe = GilProbe()
    with recording, pauses.watching(), probe.probing() if gil_probe else nullcontext():
        steps.restart()
        cpu_start, wall_start = time.process_time(), steps.start
        passes.start = pauses.start = wall_start
        work()
        seconds = time.perf_counter() - wall_start
    cpu = time.process_time() - cpu_start
    threads_end = thread_cpu_seconds()
    loop = program_loop_cpu_seconds() - loop_start
    runtime.set_batch_hook(None)
    # The runtime's own threads (scheduler, output): alive before and after.
    engine = sum(threads_end[name] - threads_start[name] for name in threads_end
                 if name.startswith("lmnb-") and name in threads_start
                 and name not in PROGRAM_THREADS)
    return {"path": label, "programs": count, "seconds": seconds, "cpu_seconds": cpu,
            "program_loop_cpu_ms_per_program": 1e3 * loop / count,
            "programs_per_s": count / seconds, "cpu_ms_per_program": 1e3 * cpu / count,
            "engine_threads_cpu_ms_per_program": 1e3 * engine / count,
            "other_cpu_ms_per_program": 1e3 * (cpu - engine) / count,
            "gc_collections": pauses.counts, "gc_full_seconds": pauses.full_seconds,
            "gc_full_at_s": pauses.full_at, "timeline": steps.summary() if timeline else {},
            **passes.summary(), "after_last_pass_s": seconds - (passes.summary()[
                "last_pass_end_s"] or 0.0),
            "gil_probe": {"to_first_pass": probe.summary(passes.summary()["first_pass_end_s"]),
                          "to_last_extend": probe.summary(passes.summary()["last_extend_end_s"])}
            if gil_probe else {}}


SCHEDULE_PATHS = ("dsl run_batch", "raw generate, text", "raw generate, ids")
PATH_NAMES = {"dsl": "dsl run_batch", "dsl-recorder": "dsl run_batch (programs.py recorder)",
              "dsl-unbatched": "dsl run_batch, unbatched submits",
              "raw-ids": "raw generate, ids", "raw-text": "raw generate, text"}
SCHEDULE_KEYS = ("forward_passes", "extend_passes", "requests_per_extend_pass",
                 "tokens_per_extend_pass", "first_pass_end_s", "last_extend_end_s",
                 "last_pass_end_s", "after_last_pass_s", "gc_collections", "gc_full_seconds",
                 "gc_full_at_s", "timeline")


def pass_comparison(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The passes of the DSL path beside the raw paths': whether its first extend pass held as
    many requests as the raw text path's, and as many extend passes in all."""
    out = {label: {key: results[label][key] for key in SCHEDULE_KEYS}
           for label in results if label in SCHEDULE_PATHS or "switch" in label
           or "wave " in label}
    dsl, raw = out.get("dsl run_batch"), out.get("raw generate, text")
    if dsl is not None and raw is not None:
        first = [r["requests_per_extend_pass"][:1] for r in (dsl, raw)]
        dsl["same_first_extend_as_raw_text"] = first[0] == first[1]
        dsl["extend_passes_over_raw_text"] = dsl["extend_passes"] / max(raw["extend_passes"], 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("mmlu", "shared-prefix"), default="mmlu",
                        help="programs.py's MMLU (one 4-token gen), or 8 prefixes of 1,400 "
                        "words x 32 questions (one 16-token gen)")
    parser.add_argument("--prefixes", type=int, default=8, help="shared-prefix: prefixes")
    parser.add_argument("--questions", type=int, default=32,
                        help="shared-prefix: questions per prefix")
    parser.add_argument("--scale", type=float, default=25.0,
                        help="programs.py's MMLU scale: 12 programs per unit (default 300)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per path; the fastest counts")
    parser.add_argument("--paths", default=",".join(PATH_NAMES),
                        help="comma-separated paths to run, of " + ", ".join(PATH_NAMES)
                        + " (dsl and raw-text always run)")
    parser.add_argument("--top", type=int, default=30, help="rows of each profile table")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-timeline", action="store_true",
                        help="no request timeline (when each path's requests reached the "
                        "interpreter, the runtime, the scheduler and the first pass)")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--model", default=None, help="a model folder (instead of the "
                        "nearly-free random model)")
    parser.add_argument("--dummy-config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="random weights of a real architecture (bench/dummy_models.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval (s): a tiny one lets the scheduler thread "
                        "take requests as they arrive, as on a GPU (default: Python's 5 ms)")
    parser.add_argument("--compare-switch-interval", type=float, default=None,
                        help="also run the DSL and raw text paths with this GIL switch "
                        "interval (s) set around them: a scheduler thread starved of the GIL "
                        "while other threads run Python launches its passes late")
    parser.add_argument("--batch-switch-interval", default="default",
                        help="global_config.batch_switch_interval: the GIL switch interval (s) "
                        "while a run_batch starts its programs; 'none': Python's own "
                        "(lmnb.lang.gil_share); default: lmnb's default")
    parser.add_argument("--compare-batch-switch-intervals", default="",
                        help="comma-separated values ('none' included) of "
                        "--batch-switch-interval to run the DSL path with once more each, "
                        "beside the default one (one model load)")
    parser.add_argument("--batch-wave", default="default",
                        help="global_config.batch_wave: 'none', a run_batch's programs start "
                        "together and their gens reach the scheduler in one hand-over; n, in "
                        "waves of n, 2n, ...; default: lmnb's")
    parser.add_argument("--batch-lead-wave", default="default",
                        help="global_config.batch_lead_wave: with --batch-wave none, the programs "
                        "a run_batch starts first, spread over the batch, before the rest "
                        "('none': all together; lmnb.lang.batch_waves); default: lmnb's")
    parser.add_argument("--compare-batch-lead-waves", default="",
                        help="comma-separated values ('none' included) of --batch-lead-wave to "
                        "run the DSL path with once more each")
    parser.add_argument("--compare-batch-waves", default="",
                        help="comma-separated values ('none' included) of --batch-wave to run "
                        "the DSL path with once more each")
    parser.add_argument("--overlap", action="store_true",
                        help="the overlap schedule on the CPU too (disable_overlap_schedule="
                        "False): passes are launched ahead of their results, as on a GPU")
    parser.add_argument("--simulate-gpu", type=int, default=0, metavar="OPS",
                        help="with --overlap on the CPU: each pass launch also makes OPS tiny "
                        "torch calls (each hands the GIL over, as a GPU launch's kernels do) and "
                        "its result comes 0.15 s + 20 us per prompt token later (decode: 10 ms), "
                        "as from a device; the CUDA prefill chunk (8192). 4000 gives a launch "
                        "3-4x slower beside a busy program loop, as measured on the H100")
    parser.add_argument("--device-from-launch-start", action="store_true",
                        help="with --simulate-gpu: a pass's device time runs from its launch's "
                        "start (kernels run as they are queued), ending no earlier than the "
                        "launch; default: from the launch's end")
    parser.add_argument("--gil-probe", action="store_true",
                        help="a thread that sleeps 0.2 ms at a time notes how late it wakes "
                        "(request_timeline.GilProbe): how long a thread giving up the GIL, as the "
                        "scheduler does at each torch call, waits to get it back")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of the nearly-free model: many layers make each pass's "
                        "launch hand the GIL back and forth as often as a real model's on a GPU")
    parser.add_argument("--max-total-tokens", type=int, default=400_000)
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the runtime is up (as vLLM's engine does): full "
                        "collections then skip the model's objects (compare gc_full_seconds)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "dsl_overhead.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.model and args.dummy_config:
        raise SystemExit("--model and --dummy-config exclude each other")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    for name, parse, _ in BATCH_SETTINGS:
        if (value := getattr(args, name)) != "default":
            setattr(lmnb.global_config, name, setting(value, parse))
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from lmnb.lang.backends.local import LocalBackend
    from lmnb.runtime.engine import Runtime
    from lmnb.runtime.models import loader

    hf_logging.set_verbosity_error()
    options: dict[str, Any] = dict(device=args.device, max_total_tokens=args.max_total_tokens,
                                   max_running_requests=1024,
                                   disable_radix_cache=args.disable_radix_cache)
    if args.overlap or args.simulate_gpu:
        options["disable_overlap_schedule"] = False
    if args.simulate_gpu:
        simulate_gpu(args.simulate_gpu, from_launch_start=args.device_from_launch_start)
        options["chunked_prefill_size"] = 8192
    with tempfile.TemporaryDirectory(prefix="lmnb-dsl-overhead-") as scratch:
        if args.model:
            model, label = args.model, args.model
        elif args.dummy_config:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
            model, label = str(dummy.path), dummy.label
            options.update(dummy.runtime_options())
        else:
            tokenizer_dir = loader.resolve_model_dir(args.tokenizer)
            folder = Path(scratch) / "nearly-free"
            folder.mkdir()
            config = {**NEARLY_FREE, "num_hidden_layers": args.layers,
                      "vocab_size": len(loader.load_tokenizer(tokenizer_dir))}
            (folder / "config.json").write_text(json.dumps(config))
            model, label = str(folder), "nearly-free 1-layer random Llama"
            options.update(tokenizer_path=str(tokenizer_dir), load_format="dummy",
                           dtype="float32", context_length=4096)
        runtime = Runtime(model, **options)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    try:
        return run(args, runtime, LocalBackend, label)
    finally:
        runtime.close()


SWITCH_DSL, SWITCH_RAW = "dsl run_batch", "raw generate, text"


def switched(interval: float, work: Callable[[], Any]) -> Callable[[], Any]:
    """`work` with the GIL switch interval set to `interval` while it runs."""
    def run_switched() -> Any:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        try:
            return work()
        finally:
            sys.setswitchinterval(previous)
    return run_switched


def simulate_gpu(ops: int, *, from_launch_start: bool = False) -> None:
    """`--simulate-gpu`: `ModelRunner.launch` makes `ops` tiny torch calls first, and each
    launched pass's `result()` waits until its simulated device time has passed: counted from
    the launch's end, or (`from_launch_start`) from its start, as a device runs kernels as they
    are queued (a launch slowed by other threads then hides behind the device's work)."""
    import torch

    from lmnb.runtime.core import ForwardMode
    from lmnb.runtime.model_runner import ModelRunner, PendingStep

    scratch = torch.zeros(4)
    launch, result = ModelRunner.launch, PendingStep.result
    ready: dict[int, float] = {}  # id(pending) -> when its device work is done

    def simulated_launch(self: Any, batch: Any, rows: Any) -> Any:
        start = time.perf_counter()
        for _ in range(ops):
            torch.add(scratch, 1)
        pending = launch(self, batch, rows)
        device_s = (0.15 + 2e-5 * sum(batch.extend_lens) if batch.mode is ForwardMode.EXTEND
                    else 0.01)
        end = time.perf_counter()
        ready[id(pending)] = max(start + device_s, end) if from_launch_start else end + device_s
        return pending

    def simulated_result(self: Any) -> Any:
        wait = ready.pop(id(self), 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return result(self)

    ModelRunner.launch = simulated_launch  # type: ignore[method-assign]
    PendingStep.result = simulated_result  # type: ignore[method-assign]


# The run_batch settings of `global_config` the bench sets (`--batch-wave`, ...) and compares
# (`--compare-batch-waves`, ...): (name, its values' type, the label of a compared run).
BATCH_SETTINGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("batch_switch_interval", float, "batch switch"), ("batch_wave", int, "wave"),
    ("batch_lead_wave", int, "lead wave"))


def setting(value: str, parse: Callable[[str], Any]) -> Any:
    """A command-line value of a `BATCH_SETTINGS` entry: 'none' is None."""
    return None if value == "none" else parse(value)


def configured(name: str, value: Any, work: Callable[[], Any]) -> Callable[[], Any]:
    """`work` with `global_config.<name>` set to `value` while it runs."""
    def run_configured() -> Any:
        previous = getattr(lmnb.global_config, name)
        setattr(lmnb.global_config, name, value)
        try:
            return work()
        finally:
            setattr(lmnb.global_config, name, previous)
    return run_configured


def run(args: argparse.Namespace, runtime: Any, backend_type: type,
        model_label: str = "") -> dict[str, Any]:
    rng = random.Random(programs.SEED)  # the data, built once
    if args.workload == "mmlu":
        job, gen_tokens = programs.mmlu(rng, args.scale), GEN_TOKENS
    else:
        job, gen_tokens = shared_prefix(rng, args.prefixes, args.questions), PREFIX_GEN_TOKENS

    def dsl_job() -> Callable[[Any], int]:
        return job

    runtime.generate("Hello, world.", {"max_new_tokens": 2, "temperature": 0.0})
    # The prompts the DSL sends, as ids (recorded once): the raw paths send the same.
    recorder = programs.RecordingRuntime(runtime)
    count = dsl_job()(backend_type(recorder))
    recorded = [r.input_ids for r in recorder.requests if r.meta_info["completion_tokens"]]
    texts = [runtime.tokenizer.decode(ids, skip_special_tokens=True) for ids in recorded]
    params = {"max_new_tokens": gen_tokens, "min_new_tokens": gen_tokens, "temperature": 0.0}
    paths: dict[str, Callable[[], Any]] = {
        "dsl run_batch": lambda: dsl_job()(backend_type(runtime)),
        "dsl run_batch (programs.py recorder)": lambda: dsl_job()(backend_type(
            programs.RecordingRuntime(runtime))),
        "dsl run_batch, unbatched submits": lambda: dsl_job()(backend_type(
            UnbatchedSubmits(runtime))),
        "raw generate, ids": lambda: runtime.generate(input_ids=recorded,
                                                      sampling_params=params),
        "raw generate, text": lambda: runtime.generate(texts, params),
    }
    wanted = {PATH_NAMES[name.strip()] for name in args.paths.split(",") if name.strip()}
    paths = {label: work for label, work in paths.items()
             if label in wanted or label in (SWITCH_DSL, SWITCH_RAW)}
    if args.compare_switch_interval is not None:
        tag = f" @ switch {args.compare_switch_interval:g} s"
        paths[SWITCH_DSL + tag] = switched(args.compare_switch_interval, paths["dsl run_batch"])
        paths[SWITCH_RAW + tag] = switched(args.compare_switch_interval,
                                           paths["raw generate, text"])
    for name, parse, label in BATCH_SETTINGS:
        compared = getattr(args, f"compare_{name}s").split(",")
        for value in filter(None, (v.strip() for v in compared)):
            paths[f"{SWITCH_DSL} @ {label} {value}"] = configured(
                name, setting(value, parse), paths[SWITCH_DSL])
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in paths}
    for _ in range(args.repeats):  # interleaved: drift in the machine's load hits every path
        for label, work in paths.items():
            runs[label].append(measure(
                label, runtime, count if label.startswith("dsl") else len(recorded), work,
                timeline=not args.no_timeline, gil_probe=args.gil_probe))
    results = {label: {**min(runs[label], key=lambda r: r["cpu_seconds"]),
                       "seconds_all": [r["seconds"] for r in runs[label]],
                       "seconds_min": min(r["seconds"] for r in runs[label])}
               for label in paths}
    profile: dict[str, str] = {}
    if not args.no_profile:
        runtime.flush_cache()
        with profiled_threads(True) as profiles:
            dsl_job()(backend_type(runtime))
        profile = {"cumulative": top_table(profiles, "cumulative", args.top),
                   "tottime": top_table(profiles, "tottime", args.top)}
    print(f"dsl_overhead: {args.workload}, {count} programs ({len(recorded)} gens), "
          f"{model_label} on {runtime.device}, radix cache "
          f"{'off' if args.disable_radix_cache else 'on'}")
    print(format_table(
        ["path", "programs", "seconds", "cpu s", "prog/s", "cpu ms/prog", "engine thr ms",
         "loop ms", "other ms", "fwd passes", "mean batch", "max batch"],
        [(r["path"], r["programs"], r["seconds"], r["cpu_seconds"], r["programs_per_s"],
          r["cpu_ms_per_program"], r["engine_threads_cpu_ms_per_program"],
          r["program_loop_cpu_ms_per_program"],
          r["other_cpu_ms_per_program"], r["forward_passes"], r["mean_batch"],
          r["largest_batch"])
         for r in results.values()]))
    floor = results["raw generate, text"]["cpu_ms_per_program"]
    dsl = results["dsl run_batch"]["cpu_ms_per_program"]
    wall = results["dsl run_batch"]["seconds"] / results["raw generate, text"]["seconds"]
    wall_min = results["dsl run_batch"]["seconds_min"] / results["raw generate, text"][
        "seconds_min"]
    print(f"DSL CPU per program (one gen) / raw text generate per request: {dsl / floor:.2f}x "
          f"(target <= 1.1x); wall time: {wall:.2f}x (fastest of each: {wall_min:.2f}x; "
          "target <= 1.03x)")
    schedule = pass_comparison(results)
    print("\nHow the requests reached the scheduler (the run above of each path):")
    print(format_table(
        ["path", "passes", "extend", "first pass ends s", "last extend ends s",
         "after last pass s", "gc full s", "requests per extend pass", "tokens per extend pass"],
        [(label, r["forward_passes"], r["extend_passes"], r["first_pass_end_s"],
          r["last_extend_end_s"], r["after_last_pass_s"], r["gc_full_seconds"],
          " ".join(map(str, r["requests_per_extend_pass"])),
          " ".join(map(str, r["tokens_per_extend_pass"]))) for label, r in schedule.items()]))
    timelines = {label: r["timeline"] for label, r in schedule.items() if r["timeline"]}
    if timelines:
        print("\nRequest timeline (ms after the path's start; the run above; first / last time):")
        print(format_table(["path", "", *STEPS], timeline_rows(timelines)))
        for label, summary in timelines.items():
            print(f"  CPU s per thread until the first pass ended, {label}: "
                  f"{summary['thread_cpu_s_to_first_pass']}")
    switched_paths = [label for label in results if "@ switch" in label]
    if len(switched_paths) == 2:
        dsl_switched, raw_switched = (results[label]["seconds_min"] for label in switched_paths)
        print(f"With the switch interval of --compare-switch-interval: DSL / raw text wall time "
              f"{dsl_switched / raw_switched:.2f}x (fastest of each)")
    probed = {label: r["gil_probe"] for label, r in results.items() if r["gil_probe"]}
    if probed:
        print("\nGIL probe: wake-up delays of a thread sleeping 0.2 ms at a time, until the "
              "first pass ended / until the last extend pass ended (ms; s: time spent waking "
              "more than 1 ms late):")
        print(format_table(
            ["path", "first: p50", "p99", "max", "s > 1 ms", "extends: p50", "p99", "max",
             "s > 1 ms"],
            [(label, *(p[window].get(key) for window in ("to_first_pass", "to_last_extend")
                       for key in ("p50_ms", "p99_ms", "max_ms", "over_1ms_s")))
             for label, p in probed.items()]))
    raw_fastest = results[SWITCH_RAW]["seconds_min"]
    for label in (label for label in results if "@ batch switch" in label):
        print(f"{label}: DSL / raw text wall time "
              f"{results[label]['seconds_min'] / raw_fastest:.2f}x (fastest of each; with "
              f"the default {lmnb.global_config.batch_switch_interval:g} s: {wall_min:.2f}x)")
    for label in (label for label in results if "@ wave" in label):
        print(f"{label}: DSL / raw text wall time "
              f"{results[label]['seconds_min'] / raw_fastest:.2f}x (fastest of each; with "
              f"the default wave {lmnb.global_config.batch_wave}: {wall_min:.2f}x)")
    for label in (label for label in results if "@ lead wave" in label):
        print(f"{label}: DSL / raw text wall time "
              f"{results[label]['seconds_min'] / raw_fastest:.2f}x (fastest of each; with "
              f"the default lead wave {lmnb.global_config.batch_lead_wave}: {wall_min:.2f}x)")
    for sort, table in profile.items():
        print(f"\n---- DSL run, profile by {sort} (main, program loop, threads started) ----")
        print(table)
    payload = {
        "benchmark": "dsl_overhead",
        "config": {"workload": args.workload, "scale": args.scale, "programs": count,
                   "gen_tokens": gen_tokens,
                   "repeats": args.repeats, "model": model_label,
                   "radix_cache": not args.disable_radix_cache, "gc_freeze": args.gc_freeze,
                   "batch_switch_interval": lmnb.global_config.batch_switch_interval,
                   "batch_wave": lmnb.global_config.batch_wave,
                   "batch_lead_wave": lmnb.global_config.batch_lead_wave},
        "results": results,
        "dsl_over_raw_text_cpu": dsl / floor,
        "dsl_over_raw_text_wall": wall,
        "dsl_over_raw_text_wall_fastest": wall_min,
        "pass_comparison": schedule,
        "profile": profile,
        "environment": environment(str(runtime.device)),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
