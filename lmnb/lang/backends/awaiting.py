"""Awaiting a backend from the program loop: a backend with coroutine calls (`AsyncBackend`:
`LocalBackend` submits into its runtime and awaits the output stream) is awaited directly; any
other backend's blocking calls run on the loop's thread pool, their streamed text handed back to
the loop in order."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from lmnb.lang.backends.base import Generation, MediaInput
from lmnb.lang.ir import GenParams


@runtime_checkable
class AsyncBackend(Protocol):
    """A backend whose calls are coroutines run on the program loop (`Backend`'s, awaited)."""

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        cancel: threading.Event | None = None,
                        **extra: Any) -> Generation:
        ...

    async def aselect(self, prompt: str, choices: tuple[str, ...], method: str, *,
                      media: Sequence[MediaInput] = ()) -> tuple[str, dict]:
        ...

    async def acache_prefix(self, prompt: str, *, media: Sequence[MediaInput] = ()) -> None:
        ...


def _owner(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


@functools.cache
def _awaited_calls(cls: type) -> frozenset[str]:
    """The calls of a backend class that are awaited (`generate` for `agenerate`, ...): all of an
    `AsyncBackend`'s, except those whose blocking form a subclass overrides (a subclass of
    `LocalBackend` that wraps `generate` is called through its `generate`)."""
    if not issubclass(cls, AsyncBackend):
        return frozenset()
    calls = set()
    for name in ("generate", "select", "cache_prefix"):
        sync, coroutine = _owner(cls, name), _owner(cls, "a" + name)
        if coroutine is not None and not (sync is not coroutine and sync is not None
                                          and issubclass(sync, coroutine)):
            calls.add(name)
    return frozenset(calls)


def awaited_calls(backend: object) -> frozenset[str]:
    """Which of `backend`'s calls the program loop awaits (those of an `AsyncBackend`); the
    others run on a pool thread."""
    return _awaited_calls(type(backend))


_Update = TypeVar("_Update")


def on_loop_thread(on_update: Callable[[_Update], None] | None
                   ) -> Callable[[_Update], None] | None:
    """`on_delta` (or `on_meta`) for a call running on a pool thread: each update is handed to
    the loop (in order, before the call's result, which the loop also receives through
    `call_soon`)."""
    if on_update is None:
        return None
    loop = asyncio.get_running_loop()
    return lambda update: loop.call_soon_threadsafe(on_update, update)


async def in_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`func(*args, **kwargs)` on the loop's pool of threads for blocking calls."""
    return await asyncio.get_running_loop().run_in_executor(None, lambda: func(*args, **kwargs))
