"""The program loop: one asyncio event loop, on a daemon thread of its own, where every program's
executor runs as a task (never the kernel's loop: a cell's top-level `await` bridges to it).

Synchronous code waits for the loop with `block_on(coroutine)`: a thread blocks on a future (the
main thread in 50 ms slices, so that a simulated Ctrl-C lands; nothing else wakes on a timer). A
program body run on the loop by `run_body` is a greenlet: `block_on` inside it (its `s["x"]`,
`s.text()`, `s.fork()`) suspends the body while the loop awaits, so batched bodies that read
their state take no thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import greenlet

from lmnb.lang.gil_share import thread_ended
from lmnb.runtime.output.loop_waker import loop_waker

T = TypeVar("T")

# Threads for backends whose calls block (OpenAI's client, HTTP endpoints, custom SGLang
# backends): one per call in flight, up to this many, reused.
SYNC_CALL_THREADS = 256
_MAIN_WAIT_S = 0.05  # the main thread's wait slice: `_thread.interrupt_main` wakes no lock


class _ProgramLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
            max_workers=SYNC_CALL_THREADS, thread_name_prefix="lmnb-sync-call"))
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), name="lmnb-programs",
                                       daemon=True)
        self.thread.start()
        started.wait()
        self.ident = self.thread.ident

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:  # (a callback's SystemExit or KeyboardInterrupt) no batch is starting now
            thread_ended()


_current: _ProgramLoop | None = None
_lock = threading.Lock()


def program_loop() -> asyncio.AbstractEventLoop:
    """The shared program loop, started on first use."""
    global _current
    current = _current
    if current is None or not current.thread.is_alive():
        with _lock:
            if _current is None or not _current.thread.is_alive():
                _current = _ProgramLoop()
            current = _current
    return current.loop


def on_program_loop() -> bool:
    """True on the program loop's thread (a body greenlet included)."""
    current = _current
    return current is not None and threading.get_ident() == current.ident


def call_soon(callback: Callable[..., Any], *args: Any) -> None:
    """Runs `callback(*args)` on the program loop, soon; from any thread (in the caller's
    context, in the order of the calls; other threads' calls wake the loop once per burst)."""
    loop = program_loop()
    if on_program_loop():
        loop.call_soon(callback, *args)
    else:
        loop_waker(loop).call(callback, args)


class _Body(greenlet.greenlet):
    """A program body running on the program loop (see `run_body`)."""


async def run_body(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs the synchronous `func` on the program loop: each `block_on(awaitable)` it makes
    switches back here, the awaitable is awaited, and the body resumes with its result (or its
    error). Returns what `func` returns. Runs in a copy of the caller's context."""
    body = _Body(func, greenlet.getcurrent())
    body.gr_context = contextvars.copy_context()
    step = body.switch(*args, **kwargs)
    while not body.dead:
        try:
            value = await step
        except BaseException as error:  # noqa: BLE001 - raised in the body, where it waits
            step = body.throw(error)
        else:
            step = body.switch(value)
    return step


def in_body() -> bool:
    return isinstance(greenlet.getcurrent(), _Body)


def block_on(awaitable: Coroutine[Any, Any, T]) -> T:
    """Waits for `awaitable`, run on the program loop: suspends a body greenlet, blocks a thread
    (Ctrl-C on the main thread cancels the wait and is raised). Not on the loop's own thread
    outside a body: that would stop every program."""
    current = greenlet.getcurrent()
    if isinstance(current, _Body):
        return current.parent.switch(awaitable)
    if on_program_loop():
        awaitable.close()
        raise RuntimeError("a program state was read on the program loop outside a program "
                           "body; await it instead")
    return wait_future(asyncio.run_coroutine_threadsafe(awaitable, program_loop()))


def wait_future(future: concurrent.futures.Future[T]) -> T:
    """`future.result()`; on the main thread in slices (an interrupt cancels the future)."""
    if threading.current_thread() is not threading.main_thread():
        return future.result()
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    try:
        while not done.wait(_MAIN_WAIT_S):
            pass
    except KeyboardInterrupt:
        future.cancel()
        raise
    return future.result()


def wait_queue(items: queue.SimpleQueue[T]) -> T:
    """`items.get()`; on the main thread in slices, so that an interrupt lands."""
    if threading.current_thread() is not threading.main_thread():
        return items.get()
    while True:
        try:
            return items.get(timeout=_MAIN_WAIT_S)
        except queue.Empty:
            continue


async def on_loop(awaitable: Coroutine[Any, Any, T]) -> T:
    """Awaits `awaitable` on the program loop from any event loop (a kernel cell's, with
    top-level await): that loop is never blocked."""
    loop = program_loop()
    if asyncio.get_running_loop() is loop:
        return await awaitable
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(awaitable, loop))
