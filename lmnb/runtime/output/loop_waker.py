"""Waking asyncio futures (and running callbacks) from other threads, one `call_soon_threadsafe`
per burst: the output
thread delivers to every stream of a step, and the loop that awaits them (the program loop,
awaiting hundreds of streams) is woken once, not once per stream. Inside `held_wakes()` a
thread's wake-ups wait until the block ends: the loop then wakes after the step's last delivery,
instead of taking the GIL back and forth with the thread still delivering."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class LoopWaker:
    """Runs callbacks on one event loop from any thread, in order, each in its caller's context
    (or none): the calls made before the loop runs the burst run together, after one
    `call_soon_threadsafe`. `wake` sets futures this way."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[contextvars.Context | None, Callable[..., Any],
                                  tuple[Any, ...]]] = []

    def wake(self, *futures: asyncio.Future) -> None:
        """Sets `futures`' results (None) on the loop; nothing when the loop is closed (nobody
        waits any more)."""
        try:
            self._add([(None, _wake, (future,)) for future in futures])
        except RuntimeError:
            pass

    def call(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """`callback(*args)` on the loop in the caller's context; RuntimeError if it is closed."""
        self._add([(contextvars.copy_context(), callback, args)])

    def _add(self, items: list[tuple[contextvars.Context | None, Callable[..., Any],
                                     tuple[Any, ...]]]) -> None:
        with self._lock:
            scheduled = bool(self._pending)
            self._pending.extend(items)
            if scheduled:  # a burst is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._pending.clear()
            raise

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for context, callback, args in pending:
            try:
                if context is None:
                    callback(*args)
                else:
                    context.run(callback, *args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as error:  # as the loop reports a failed callback
                self.loop.call_exception_handler({
                    "message": f"Exception in callback {callback!r}", "exception": error})


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
