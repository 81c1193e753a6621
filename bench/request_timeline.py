"""`RequestTimeline`: when the requests of one benchmark path took each step from the caller to
the first forward pass, in seconds after the path's start.

Cheap enough to leave on: while a path runs, a few classes' methods are wrapped (one clock read
and a comparison per call) and restored afterwards; nothing in lmnb is edited. Steps (the first
and last time each happened, and how often):

- `body_started`: a DSL program's body began (`Program.batch_job`'s `execute`);
- `gen_submitted`: the interpreter called the backend for a gen (`LocalBackend.agenerate`);
- `generate_called`: a `Runtime.generate` call began (the raw caller), or the DSL backend's
  `Runtime.submit_encoded`;
- `sent_to_scheduler`: requests were put into the scheduler's inbox (`SchedulerThread.submit*`);
- `added_to_waiting`: the scheduler thread added a request to its waiting queue;
- `pass_launch_started` / `pass_launch_returned`: a forward pass's host launch began / returned
  (`ModelRunner.launch`; the device may still run it);
- `pass_ended`: a forward pass was processed (the batch hook).

At the first pass's end the CPU seconds each thread of this process used since the start are
noted (Linux /proc, in clock ticks: 10 ms steps): a program loop that used most of the interval
held the GIL that the scheduler thread needed to launch the pass.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STEPS = ("body_started", "gen_submitted", "generate_called", "sent_to_scheduler",
         "added_to_waiting", "pass_launch_started", "pass_launch_returned", "pass_ended")


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


@dataclasses.dataclass
class _Step:
    first: float
    last: float
    count: int = 1


class RequestTimeline:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: dict[str, _Step] = {}
        self._cpu_start: dict[str, float] = {}
        self.cpu_to_first_pass: dict[str, float] = {}

    def restart(self) -> None:
        """Clears the steps; times count from now."""
        self.steps.clear()
        self.cpu_to_first_pass = {}
        self._cpu_start = thread_cpu_seconds()
        self.start = time.perf_counter()

    def mark(self, step: str, count: int = 1) -> None:
        now = time.perf_counter() - self.start
        entry = self.steps.get(step)
        if entry is None:
            self.steps[step] = _Step(now, now, count)
            if step == "pass_ended":
                end = thread_cpu_seconds()
                self.cpu_to_first_pass = {name: round(end[name] - self._cpu_start.get(name, 0.0), 4)
                                          for name in end if name.startswith(("lmnb", "Main"))}
        else:
            entry.last = now
            entry.count += count

    def summary(self) -> dict[str, Any]:
        """Per step: first and last time (s after the start) and how many; the threads' CPU
        seconds until the first pass ended."""
        return {**{step: dataclasses.asdict(self.steps[step]) for step in STEPS
                   if step in self.steps},
                "thread_cpu_s_to_first_pass": self.cpu_to_first_pass}

    @contextmanager
    def recording(self) -> Iterator[RequestTimeline]:
        """Wraps the steps' methods while the block runs (restored on leaving)."""
        from lmnb.lang.backends.local import LocalBackend
        from lmnb.lang.program import Program
        from lmnb.runtime.engine import Runtime
        from lmnb.runtime.model_runner import ModelRunner
        from lmnb.runtime.scheduler.loop import SchedulerThread
        from lmnb.runtime.scheduler.scheduler import Scheduler

        mark = self.mark
        originals: list[tuple[type, str, Any]] = []

        def wrap(owner: type, name: str, make: Callable[[Any], Any]) -> None:
            original = owner.__dict__[name]
            originals.append((owner, name, original))
            setattr(owner, name, make(original))

        def batch_job(original: Any) -> Any:
            def wrapped(program: Any, *args: Any, **kwargs: Any) -> Any:
                job = original(program, *args, **kwargs)
                execute = job.execute

                def timed(arguments: dict[str, Any], run: Any) -> Any:
                    mark("body_started")
                    return execute(arguments, run)

                return dataclasses.replace(job, execute=timed)
            return wrapped

        def agenerate(original: Any) -> Any:
            async def wrapped(backend: Any, *args: Any, **kwargs: Any) -> Any:
                mark("gen_submitted")
                return await original(backend, *args, **kwargs)
            return wrapped

        def before(step: str, counted: Callable[..., int] | None = None) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def wrapped(*args: Any, **kwargs: Any) -> Any:
                    mark(step, counted(*args) if counted is not None else 1)
                    return original(*args, **kwargs)
                return wrapped
            return make

        def launch(original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                mark("pass_launch_started")
                try:
                    return original(*args, **kwargs)
                finally:
                    mark("pass_launch_returned")
            return wrapped

        wrap(Program, "batch_job", batch_job)
        wrap(LocalBackend, "agenerate", agenerate)
        wrap(Runtime, "generate", before("generate_called"))
        wrap(Runtime, "submit_encoded", before("generate_called"))
        wrap(SchedulerThread, "submit", before("sent_to_scheduler"))
        wrap(SchedulerThread, "submit_many", before(
            "sent_to_scheduler", lambda _thread, states: len(states)))
        wrap(Scheduler, "add", before("added_to_waiting"))
        wrap(ModelRunner, "launch", launch)
        try:
            yield self
        finally:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)

    def batch_hook(self, then: Callable[[Any], None] | None = None) -> Callable[[Any], None]:
        """A `Runtime.set_batch_hook` hook that marks `pass_ended`, then calls `then`."""
        def hook(batch: Any) -> None:
            self.mark("pass_ended")
            if then is not None:
                then(batch)
        return hook


def timeline_rows(timelines: dict[str, dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows for `format_table` with columns (path, "first"/"last", *STEPS): per path the first
    and the last time of each step, in milliseconds ("-": never)."""
    rows = []
    for label, summary in timelines.items():
        for which in ("first", "last"):
            rows.append((label, which, *(f"{1e3 * summary[step][which]:.1f}" if step in summary
                                         else "-" for step in STEPS)))
    return rows


class GilProbe:
    """A thread that sleeps `period` s at a time (giving up the GIL, as the scheduler thread does
    at each torch call) and notes how late it woke: how long a thread that gives the GIL up
    waits to get it back while the others run Python (about the switch interval when one of
    them runs Python without a pause). Its own work is a few operations per wake-up."""

    def __init__(self, period: float = 2e-4) -> None:
        self.period = period
        self.delays: list[tuple[float, float]] = []  # (when, s after start; how late, s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start = time.perf_counter()

    def _run(self) -> None:
        period, delays, stop, clock = self.period, self.delays, self._stop, time.perf_counter
        while not stop.is_set():
            before = clock()
            time.sleep(period)
            after = clock()
            delays.append((after - self.start, after - before - period))

    @contextmanager
    def probing(self) -> Iterator[GilProbe]:
        self.delays.clear()
        self._stop.clear()
        self.start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def summary(self, until: float | None = None) -> dict[str, float]:
        """Wake-up delays (ms) until `until` s after the start (all of them: None): median,
        99th percentile, largest, and the seconds spent waiting more than 1 ms."""
        late = sorted(d for t, d in self.delays if until is None or t <= until)
        if not late:
            return {}
        return {"wakes": len(late), "p50_ms": 1e3 * late[len(late) // 2],
                "p99_ms": 1e3 * late[min(len(late) - 1, int(0.99 * len(late)))],
                "max_ms": 1e3 * late[-1], "over_1ms_s": sum(d for d in late if d > 1e-3)}

