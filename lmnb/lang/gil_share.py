"""`sharing_the_gil()`: while the program loop starts a batch's programs, a shorter GIL switch
interval, and the loop stepping aside while the scheduler launches a pass, so that the scheduler
thread is not starved.

The program loop and the runtime's scheduler thread share one GIL. The scheduler gives it up at
every kernel launch (each torch call) and needs it back at once; a thread that wants the GIL
back gets it only when its holder gives it up, at the latest after `sys.getswitchinterval()`
(5 ms by default). While the loop runs hundreds of program bodies back to back (the start of a
`run_batch`), every torch call of the scheduler's first passes could cost it up to that long: on
an H100 the first pass of 256 programs was launched 140 ms late. For that phase only, the
interval is `global_config.batch_switch_interval` (None: Python's own); Python's is restored
when the last batch that shortened it has started its programs. Only the program loop's thread
calls these (no lock); a value set meanwhile by someone else is left alone. A block left open
by a thread that died inside it (the program loop's, stopped mid-start) restores the interval
when that thread ends (`thread_ended`), or at the next block's start; its late exit, if any,
touches nothing.

Even at 50 us a launch took 2.5x as long as with an idle loop on the H100 (121 against 49 ms for
the first pass of 256 programs): each hand-over costs the interval and two thread wake-ups. So,
given the engine's `LaunchGate`, the loop also steps aside (`step_aside()`, before each program
body and each gen submission) while a pass launch is under way: it blocks, the GIL released,
until the launch returns, at most `wait_limit` s in all per batch (a bound on what a launch
that waits for the device costs). The device computes the launched pass while the loop then runs
the later programs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmnb.runtime.launch_gate import LaunchGate


@dataclass(slots=True)
class _Shortened:
    """The interval as the batches starting their programs now have set it."""

    saved: float  # the interval before the first of them
    ours: float  # the interval they set
    owner: threading.Thread  # the thread that set it
    depth: int = 0  # blocks open now


_now: _Shortened | None = None


def _restore(shortened: _Shortened) -> None:
    global _now
    if _now is not shortened:  # restored already (its thread ended meanwhile)
        return
    _now = None
    if abs(sys.getswitchinterval() - shortened.ours) < 5e-7:
        sys.setswitchinterval(shortened.saved)


@runtime_checkable
class LaunchGated(Protocol):
    """A backend whose engine reports its pass launches (None: it does not)."""

    @property
    def launch_gate(self) -> LaunchGate | None: ...


class _StepAside:
    """One starting batch's waits on its engine's launches, `budget` s in all (a launch that
    waits for the device, or a device that is the CPU, costs the batch no more than that)."""

    def __init__(self, gate: LaunchGate, budget: float) -> None:
        self.gate = gate
        self.budget = budget

    def __call__(self) -> None:
        if self.budget > 0 and self.gate.launching_now:
            start = time.perf_counter()
            self.gate.wait(self.budget)
            self.budget -= time.perf_counter() - start


_aside: list[_StepAside] = []  # of the batches starting their programs now


def step_aside() -> None:
    """On the program loop, before a program body or a gen submission: while a batch starts its
    programs, waits for its engine's pass launch under way (if any) to return."""
    for aside in _aside:
        aside()


@contextmanager
def sharing_the_gil(interval: float | None, *, gate: LaunchGate | None = None,
                    wait_limit: float | None = None) -> Iterator[None]:
    """Sets the switch interval to `interval` (when shorter than the current one) inside the
    block; nested and overlapping blocks (on the program loop) restore it once, at the last.
    With `gate` and `wait_limit`, `step_aside()` inside the block waits for `gate`'s launches,
    `wait_limit` s in all."""
    aside = _StepAside(gate, wait_limit) if gate is not None and wait_limit else None
    if aside is not None:
        _aside.append(aside)
    try:
        with _switch_interval(interval):
            yield
    finally:
        if aside is not None:
            _aside.remove(aside)


@contextmanager
def _switch_interval(interval: float | None) -> Iterator[None]:
    global _now
    if interval is None:
        yield
        return
    if _now is not None and not _now.owner.is_alive():
        _restore(_now)  # its thread died inside a block
    if _now is None:
        current = sys.getswitchinterval()
        ours = min(current, interval)
        sys.setswitchinterval(ours)
        _now = _Shortened(current, ours, threading.current_thread())
    shortened = _now
    shortened.depth += 1
    try:
        yield
    finally:
        shortened.depth -= 1
        if shortened.depth == 0:
            _restore(shortened)


def thread_ended() -> None:
    """The calling thread is ending: an interval it shortened in blocks it will never leave is
    restored."""
    if _now is not None and _now.owner is threading.current_thread():
        _restore(_now)
