"""`sharing_the_gil()`: a shorter GIL switch interval while the program loop starts a batch's
programs, so that the scheduler thread is not starved.

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
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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


@contextmanager
def sharing_the_gil(interval: float | None) -> Iterator[None]:
    """Sets the switch interval to `interval` (when shorter than the current one) inside the
    block; nested and overlapping blocks (on the program loop) restore it once, at the last."""
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
