"""Waking asyncio futures from other threads, one `call_soon_threadsafe` per burst: the output
thread delivers to every stream of a step, and the loop that awaits them (the program loop,
awaiting hundreds of streams) is woken once, not once per stream. Inside `held_wakes()` a
thread's wake-ups wait until the block ends: the loop then wakes after the step's last delivery,
instead of taking the GIL back and forth with the thread still delivering."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class LoopWaker:
    """Wakes futures of one event loop from any thread; the futures woken before the loop runs
    its callback are set together."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future] = []

    def wake(self, *futures: asyncio.Future) -> None:
        with self._lock:
            scheduled = bool(self._pending)
            self._pending.extend(futures)
            if scheduled:  # a flush is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody waits any more
            with self._lock:
                self._pending.clear()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            _wake(future)


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = \
    weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def loop_waker(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    """The one `LoopWaker` of `loop`."""
    waker = _wakers.get(loop)
    if waker is None:
        with _wakers_lock:
            waker = _wakers.get(loop)
            if waker is None:
                waker = _wakers[loop] = LoopWaker(loop)
    return waker


class _Held(threading.local):
    def __init__(self) -> None:
        self.wakes: list[tuple[LoopWaker, asyncio.Future]] | None = None


_held = _Held()


def wake(waker: LoopWaker, future: asyncio.Future) -> None:
    """`waker.wake(future)`, or at the end of this thread's `held_wakes()` block."""
    held = _held.wakes
    if held is None:
        waker.wake(future)
    else:
        held.append((waker, future))


@contextmanager
def held_wakes() -> Iterator[None]:
    """The wake-ups (`wake`) this thread makes inside the block are sent when it ends, one
    burst per loop. Blocks nest (the outermost sends)."""
    if _held.wakes is not None:
        yield
        return
    held = _held.wakes = []
    try:
        yield
    finally:
        _held.wakes = None
        by_waker: dict[LoopWaker, list[asyncio.Future]] = {}
        for waker, future in held:
            by_waker.setdefault(waker, []).append(future)
        for waker, futures in by_waker.items():
            waker.wake(*futures)
