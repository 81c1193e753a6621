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
calls these (no lock); a value set meanwhile by someone else is left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0  # batches starting their programs now
_saved: float | None = None  # the interval before the first of them
_ours: float | None = None  # the interval they set


@contextmanager
def sharing_the_gil(interval: float | None) -> Iterator[None]:
    """Sets the switch interval to `interval` (when shorter than the current one) inside the
    block; nested and overlapping blocks (on the program loop) restore it once, at the last."""
    global _depth, _saved, _ours
    if interval is None:
        yield
        return
    if _depth == 0:
        current = sys.getswitchinterval()
        _saved, _ours = current, min(current, interval)
        sys.setswitchinterval(_ours)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _saved is not None:
            if _ours is not None and abs(sys.getswitchinterval() - _ours) < 5e-7:
                sys.setswitchinterval(_saved)
            _saved = _ours = None
