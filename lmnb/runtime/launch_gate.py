"""`LaunchGate`: whether the scheduler thread is launching a forward pass now.

A pass launch on a GPU is host work (Python, one GIL hand-over per kernel launch): while another
thread of the process runs Python without a pause, the scheduler waits for the GIL at each
hand-over and the launch takes twice as long or more. A frontend that has a burst of Python work
to do (the DSL's program loop starting a `run_batch`'s programs) reads the gate and steps aside
while a launch is under way. The scheduler thread alone opens and closes it; any thread reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class LaunchGate:
    def __init__(self) -> None:
        self._open = threading.Event()  # set: no launch under way
        self._open.set()
        self.launches = 0  # launches begun so far (tells one launch from the next)

    @contextmanager
    def launching(self) -> Iterator[None]:
        """Around one pass launch (the scheduler thread's)."""
        self.launches += 1
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    @property
    def launching_now(self) -> bool:
        return not self._open.is_set()

    def wait(self, timeout: float) -> bool:
        """Waits (GIL released) until no launch is under way, at most `timeout` s; False if one
        still is."""
        return self._open.wait(timeout)
