"""`PassGate`: a runtime's forward passes held until a test lets them through, so that a test
can act on a running request (abort it, reuse its id) knowing it has not finished, however slow
the machine: a request of N tokens cannot end before N passes were let through."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from tests.idle import GUARD_S


class PassGate:
    """The batch hook (`Runtime.set_batch_hook`) that holds the scheduler after each forward pass,
    before its outputs are delivered, until `allow` permits it or the gate is `open`. A pass
    held past `GUARD_S` goes on (a hung test ends) and `timed_out` says so."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self.timed_out = False

    def hook(self, batch: Any) -> None:
        if not self._open.is_set() and not self._permits.acquire(timeout=GUARD_S):
            self.timed_out = True

    def allow(self, passes: int = 1) -> None:
        """Lets `passes` more passes through."""
        self._permits.release(passes)

    def open(self) -> None:
        """Lets every pass through from now on."""
        self._open.set()
        self._permits.release()  # the pass held now, if any


@contextlib.contextmanager
def gated_passes(runtime: Any) -> Iterator[PassGate]:
    """A `PassGate` on `runtime`'s passes within the block, opened and removed at its end."""
    gate = PassGate()
    runtime.set_batch_hook(gate.hook)
    try:
        yield gate
    finally:
        gate.open()
        runtime.set_batch_hook(None)
    assert not gate.timed_out, "a pass was held past the guard: the test never let it through"
