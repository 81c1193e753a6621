"""`HeldSubmissions`: streamed requests that one thread submits inside a `hold()` block reach the
scheduler together when the block ends, as one inbox message, so that the scheduler plans its
next pass with all of them (the DSL's program loop holds its submissions for one iteration: the
gens of a `run_batch` then share prefill passes as one `generate` of a list does). Their
announcements to the output thread are held with them and sent just before, in one message
too: one wake-up of the output thread for the block, not one per request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lmnb.runtime.output import OutputStream
from lmnb.runtime.output.processor import OutputProcessor, Registration
from lmnb.runtime.scheduler.loop import SchedulerThread
from lmnb.runtime.scheduler.request_state import ReqState


class HeldSubmissions(threading.local):
    """Per thread: a depth of nested `hold()` blocks and the requests they hold, with their
    streams and output registrations."""

    def __init__(self, scheduler: SchedulerThread, outputs: OutputProcessor) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.depth = 0
        self.held: list[tuple[OutputStream, list[ReqState]]] = []
        self.registrations: list[Registration] = []

    def submit(self, output: OutputStream, states: list[ReqState],
               registrations: list[Registration]) -> None:
        """Registers and sends `states` (of `output`) now, or at the end of this thread's
        outermost block (`registrations` announce them to the output thread first: events of
        a request follow its registration in the output thread's inbox)."""
        if self.depth:
            self.held.append((output, states))
            self.registrations += registrations
        else:
            self.outputs.register_many(registrations)
            self.scheduler.submit_many(states)

    @contextmanager
    def hold(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.held:
                self._release()

    def _release(self) -> None:
        held, self.held = self.held, []
        registrations, self.registrations = self.registrations, []
        self.outputs.register_many(registrations)
        self.scheduler.submit_many([state for _, states in held for state in states])
        # A stream closed while its requests were held sent its abort before them: again now,
        # behind them (a duplicate abort of a finished request is a no-op).
        for output, states in held:
            if output.closed:
                for state in states:
                    self.scheduler.abort(state.rid, "interrupted")
