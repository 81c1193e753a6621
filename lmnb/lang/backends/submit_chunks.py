"""`SubmitChunks`: how the program loop's streamed requests reach one runtime's scheduler.

The gens that the programs of a `run_batch` submit in one turn of the loop are held
(`EngineSurface.batched_submits`) and sent in growing chunks, as `Runtime.generate` sends a list
of text prompts: the first `FIRST_CHUNK` as soon as they are submitted (the scheduler starts
prefilling them while the loop prepares the others), then chunks twice as large each time, and
the rest when the turn ends. The scheduler thus plans each pass with many requests, never with
the one or two that reached it first, and the engine does not wait for every program's host work
before its first pass. Inside `whole_turns()` (a `run_batch` starting its programs together,
`global_config.batch_wave` None) a turn's submissions are sent in one hand-over at its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from contextvars import ContextVar

from lmnb.runtime.prompts import FIRST_CHUNK


class _WholeTurns:
    """One `whole_turns` block. The tasks and body greenlets started inside it hold it in
    their copies of the context after it ends, so it says itself whether it is still open."""

    def __init__(self, outer: _WholeTurns | None) -> None:
        self.outer = outer
        self.ended = False

    def open(self) -> bool:
        return not self.ended or (self.outer is not None and self.outer.open())


# The innermost block around the current task or body greenlet (they copy their creator's
# context): an unrelated program's submissions on the same loop are not held.
_whole_turns: ContextVar[_WholeTurns | None] = ContextVar("whole_turns", default=None)


@contextmanager
def whole_turns() -> Iterator[None]:
    """Inside the block (on the program loop: its task and the tasks and bodies it starts),
    each turn's streamed submissions reach the scheduler together at the turn's end, not in
    growing chunks."""
    block = _WholeTurns(_whole_turns.get())
    token = _whole_turns.set(block)
    try:
        yield
    finally:
        block.ended = True
        _whole_turns.reset(token)


def _in_whole_turns() -> bool:
    block = _whole_turns.get()
    return block is not None and block.open()


class SubmitChunks:
    """One per backend: `with chunks.submitting(): runtime.generate(..., stream=True)` on the
    program loop. `hold` opens a block whose streamed submissions reach the scheduler together
    at its end (the runtime's `batched_submits`)."""

    def __init__(self, hold: Callable[[], AbstractContextManager[None]], *,
                 first: int = FIRST_CHUNK) -> None:
        self.hold = hold
        self.first = max(1, first)
        self._held: ExitStack | None = None
        self._count = 0  # submissions in the open block
        self._size = self.first  # the open block is sent once it holds this many
        self._turn = False  # an end-of-turn release is scheduled

    @contextmanager
    def submitting(self) -> Iterator[None]:
        """Around one streamed submission on the program loop."""
        if self._held is None:
            held = ExitStack()
            held.enter_context(self.hold())
            self._held = held
        if not self._turn:
            self._turn = True
            asyncio.get_running_loop().call_soon(self._end_turn)
        yield
        self._count += 1
        if self._count >= self._size and not _in_whole_turns():
            self._send()
            self._size *= 2

    def _send(self) -> None:
        held, self._held = self._held, None
        self._count = 0
        if held is not None:
            held.close()

    def _end_turn(self) -> None:
        self._turn = False
        self._send()
        self._size = self.first
