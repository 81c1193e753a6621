"""`BackendCalls`: how a program's executor calls its backend, in one of three ways: an
SGLang-style custom backend's hooks (`BaseBackend`, on a pool thread, given the executor as `s`),
an `AsyncBackend`'s coroutines awaited on the program loop (`LocalBackend`), or a blocking
backend's calls on a pool thread whose streamed deltas come back to the loop in order."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.awaiting import awaited_calls, in_thread, on_loop_thread
from lmnb.lang.backends.base import (
    Backend,
    BaseBackend,
    CancelEvent,
    Generation,
    ProgramExecutor,
    sglang_generate,
    sglang_select,
    streams_meta_info,
)
from lmnb.lang.ir import GenParams


@functools.cache
def _takes_on_meta(cls: type, *, awaited: bool) -> bool:
    """Whether the `generate` (`agenerate`) the program calls takes `on_meta=`: a subclass of a
    `MetaInfoStreaming` backend may override it with the older signature."""
    method = cls.agenerate if awaited else cls.generate  # type: ignore[attr-defined]
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == "on_meta" or p.kind is p.VAR_KEYWORD for p in parameters)


class BackendCalls:
    """`generate`, `select` and `cache_prefix` of one backend, as coroutines on the program
    loop. `extra` are the protocol's optional keywords (`media=`, `chat=`, `trace=`), given only
    when set; an SGLang-style backend's hooks read the prompt from `s` instead."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.sglang: BaseBackend | None = backend if isinstance(backend, BaseBackend) else None
        self._awaited = awaited_calls(backend)
        self._streams_meta = streams_meta_info(backend) and _takes_on_meta(
            type(backend), awaited="generate" in self._awaited)

    async def generate(self, s: ProgramExecutor, prompt: str, params: GenParams, *,
                       cancel: CancelEvent, on_delta: Callable[[str], None] | None = None,
                       on_meta: Callable[[dict[str, Any]], None] | None = None,
                       **extra: Any) -> Generation:
        """`on_meta` is given to backends that stream meta info (`streams_meta_info`)."""
        if self.sglang is not None:
            return await in_thread(sglang_generate, self.sglang, s, params,
                                   on_delta=on_loop_thread(on_delta),
                                   on_meta=on_loop_thread(on_meta), cancel=cancel)
        if on_meta is not None and self._streams_meta:
            extra["on_meta"] = on_meta
        if "generate" in self._awaited:
            return await self.backend.agenerate(  # type: ignore[attr-defined]
                prompt, params, on_delta=on_delta, cancel=cancel, **extra)
        if "on_meta" in extra:
            extra["on_meta"] = on_loop_thread(on_meta)
        return await in_thread(self.backend.generate, prompt, params,
                               on_delta=on_loop_thread(on_delta), cancel=cancel, **extra)

    async def select(self, s: ProgramExecutor, prompt: str, choices: tuple[str, ...],
                     method: str, **extra: Any) -> tuple[str, dict]:
        if self.sglang is not None:
            return await in_thread(sglang_select, self.sglang, s, choices, method)
        if "select" in self._awaited:
            return await self.backend.aselect(  # type: ignore[attr-defined]
                prompt, choices, method, **extra)
        return await in_thread(self.backend.select, prompt, choices, method, **extra)

    async def cache_prefix(self, s: ProgramExecutor, prompt: str, **extra: Any) -> None:
        if self.sglang is not None:
            await in_thread(self.sglang.commit_lazy_operations, s)
        elif "cache_prefix" in self._awaited:
            await self.backend.acache_prefix(prompt, **extra)  # type: ignore[attr-defined]
        else:
            await in_thread(self.backend.cache_prefix, prompt, **extra)
