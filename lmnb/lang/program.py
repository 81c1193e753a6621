"""`@function` programs and the state `s` they write to.

    @lmnb.function
    def qa(s, question):
        s += lmnb.user(question)
        s += lmnb.assistant(lmnb.gen("answer", max_tokens=64))

    state = qa.run(question="...", temperature=0)   # state["answer"], state.text()
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.base import Backend, PrefixPinning
from lmnb.lang.backends.local import LocalBackend, start_trace
from lmnb.lang.batch import BatchArguments, BatchRunnable
from lmnb.lang.batch import BatchJob as BatchJob
from lmnb.lang.compiler import CompiledProgram
from lmnb.lang.default_backend import as_backend as as_backend
from lmnb.lang.default_backend import default_backend as default_backend
from lmnb.lang.default_backend import set_default_backend as set_default_backend
from lmnb.lang.event_loop import on_loop, run_body
from lmnb.lang.global_config import global_config
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.ir import GenParams
from lmnb.lang.program_run import ProgramRun as ProgramRun
from lmnb.lang.program_state import ProgramState as ProgramState
from lmnb.lang.run_defaults import RUN_DEFAULTS as RUN_DEFAULTS
from lmnb.lang.run_defaults import SAMPLING_DEFAULT_KEYS as SAMPLING_DEFAULT_KEYS
from lmnb.lang.run_defaults import (
    SGLANG_RUN_OPTIONS,
    batch_defaults,
    call_arguments,
    run_defaults,
)
from lmnb.lang.state_writer import PROGRAM_CALLER as PROGRAM_CALLER
from lmnb.lang.state_writer import ProgramStateGroup as ProgramStateGroup
from lmnb.lang.state_writer import StateWriter as StateWriter
from lmnb.lang.tracer import constant_prefix, trace_program


class Program(BatchRunnable):
    """A function `f(s, *args)` compiled into a runnable program."""

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None, *,
                 num_api_spec_tokens: int | None = None) -> None:
        if num_api_spec_tokens is not None and (
                isinstance(num_api_spec_tokens, bool) or not isinstance(num_api_spec_tokens, int)
                or num_api_spec_tokens < 1):
            raise ValueError(f"num_api_spec_tokens must be a positive int, got "
                             f"{num_api_spec_tokens!r}")
        self.func = func
        self.bound = dict(bound or {})
        # API speculative execution (lmnb.lang.speculation): tokens a gen may run past its stop.
        self.num_api_spec_tokens = num_api_spec_tokens
        self._signature = inspect.signature(func)
        parameters = list(self._signature.parameters.values())
        if not parameters:
            raise TypeError(f"{func.__name__} must take the program state as its first parameter")
        self._state_name = parameters[0].name
        self.arg_names = [p.name for p in parameters[1:]]
        self._pins: dict[Any, tuple[PrefixPinning, int]] = {}  # pinned prefix per runtime
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__} has no arguments {sorted(unknown)}")
        return Program(self.func, {**self.bound, **kwargs},
                       num_api_spec_tokens=self.num_api_spec_tokens)

    def split_arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict, dict]:
        """(program arguments, sampling defaults) of a call's arguments. SGLang's `n` and
        `use_thread` go to the defaults too, unless the program has a parameter of that name."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in SAMPLING_DEFAULT_KEYS or (
            k in SGLANG_RUN_OPTIONS and k not in self._signature.parameters)}
        arguments = dict(self.bound)
        try:
            bound = self._signature.bind_partial(None, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.__name__}: {error}") from None
        arguments.update({k: v for k, v in bound.arguments.items() if k != self._state_name})
        return arguments, sampling

    def run(self, *args: Any, backend: Any = None, stream: bool = False,
            token_view: bool = False, **kwargs: Any) -> ProgramState:
        """Runs the program; returns its state once done (at once with `stream=True`).
        Keyword arguments named like sampling parameters (temperature, max_new_tokens, ...) are
        the defaults of every `gen` that leaves them unset. `token_view=True` records every
        token of its gens with its origin and logprobs, for `state.token_view()` (an
        in-process runtime's backend only)."""
        arguments, sampling = self.split_arguments(args, kwargs)
        return self._execute(as_backend(backend), arguments, run_defaults(sampling), stream,
                             token_view=token_view)

    def _execute(self, backend: Backend, arguments: dict[str, Any], defaults: GenParams,
                 stream: bool, run: ProgramRun | None = None, *,
                 raise_body_error: bool = True, token_view: bool = False,
                 wait: bool = True, nested: bool = False) -> ProgramState:
        """Runs the body; the state is returned once done unless `stream` or not `wait` (a
        batch's program: its task awaits `executor.drained()`). A body that raises aborts its
        run (forks included), unless it is `nested` in a caller's run: the caller gets the
        error and decides."""
        executor = StreamExecutor(backend, defaults=defaults, stream=stream,
                                  num_api_spec_tokens=self.num_api_spec_tokens)
        if token_view:
            executor.token_trace = start_trace(backend)
        state = ProgramState(executor, run)
        caller = PROGRAM_CALLER.set(_RunningCaller(backend, defaults, state.run))
        try:
            state.ret_value = self.func(state, **arguments)
        except KeyboardInterrupt:
            state.abort()
            raise
        except Exception as error:
            # Kept, raised where the state is read; and at once from `run()` as in SGLang (a
            # streamed run returns its state first, so its reader sees it).
            executor.error = executor.error or error
            # Nothing more runs: the gens in flight, the forks' too, are aborted (their KV
            # freed). The error's frames hold `s`: a live worker would keep it forever.
            if nested:
                executor.abort()
            else:
                state.run.abort()
            executor.close()
            if not stream and raise_body_error:
                raise
        finally:
            PROGRAM_CALLER.reset(caller)
        if not stream and wait:
            state.sync()
        return state

    async def arun(self, *args: Any, backend: Any = None, token_view: bool = False,
                   **kwargs: Any) -> ProgramState:
        """`run` for asyncio: `state = await program.arun(...)` (a cell's top-level await). The
        body runs on the program loop (a greenlet: its reads suspend it), so the awaiting loop
        is never blocked; cancelling the await aborts the program's requests. `token_view` as
        in `run`."""
        arguments, sampling = self.split_arguments(args, kwargs)
        backend = as_backend(backend)
        run = ProgramRun()
        try:
            return await on_loop(run_body(self._execute, backend, arguments,
                                          run_defaults(sampling), False, run,
                                          token_view=token_view))
        except asyncio.CancelledError:
            run.abort()
            raise

    def batch_job(self, batch_kwargs: BatchArguments, *, backend: Any,
                  sampling: dict[str, Any]) -> BatchJob:
        backend = as_backend(backend)
        defaults = batch_defaults(sampling)
        batch = [self.split_arguments(*call_arguments(item))[0] for item in batch_kwargs]
        precache = global_config.enable_precache_with_tracing and len(batch) > 1
        prefix = constant_prefix(self, backend) if precache else ""
        return BatchJob(self.__name__, backend, prefix, batch,
                        lambda arguments, run: self._execute(backend, arguments, defaults,
                                                             stream=False, run=run,
                                                             raise_body_error=False,
                                                             wait=False))

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """The program as an IR graph; unbound arguments stay symbolic. The graph does not
        depend on a backend (`backend` is accepted as in SGLang)."""
        del backend

        return trace_program(self, {**self.bound, **kwargs})

    def compile(self, *, backend: Any = None) -> Any:
        """A graph-executed version of the program (no data-dependent control flow); the backend
        is chosen when it runs (`backend` is accepted as in SGLang)."""
        del backend

        return CompiledProgram(self)

    def cache(self, backend: Any = None) -> str:
        """SGLang's `cache`: sends the text every run of the program starts with (its constant
        prefix, found by tracing) to the backend's prefix cache; returns that text."""

        backend = as_backend(backend)
        prefix = constant_prefix(self, backend)
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    def pin(self, backend: Any = None) -> str:
        """SGLang's `pin`: caches the program's constant prefix (as `cache`) and keeps it in the
        backend's cache until `unpin()`: the runtime's evictions skip it. Once per backend;
        returns the prefix. A backend that cannot pin (not `PrefixPinning`) only caches it."""

        backend = as_backend(backend)
        prefix = constant_prefix(self, backend)
        target = _pin_target(backend)
        if not prefix or target in self._pins:
            return prefix
        if not isinstance(backend, PrefixPinning):
            warnings.warn(f"{type(backend).__name__} cannot pin a prefix; {self.__name__}'s "
                          f"prefix is cached, and may be evicted", stacklevel=2)
            backend.cache_prefix(prefix)
            return prefix
        self._pins[target] = (backend, backend.pin_prefix(prefix))
        return prefix

    def unpin(self, backend: Any = None) -> bool:
        """Releases what `pin()` pinned on `backend` (it stays cached, evictable again); False
        if nothing was pinned there."""
        entry = self._pins.pop(_pin_target(as_backend(backend)), None)
        if entry is None:
            return False
        pinned_on, pin = entry
        return bool(pinned_on.unpin_prefix(pin))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`program(...)` is `program.run(...)`. Inside another program's body (SGLang's nested
        call) it is a program of its own on the caller's backend and sampling defaults, whose
        state the caller reads (`sub = other(q); s += sub["answer"]`), and it traces and
        compiles with the caller. Given a state first (`other(s, q)`), its body writes to that
        state, as a subroutine of the caller."""
        if args and isinstance(args[0], StateWriter):
            arguments, sampling = self.split_arguments(args[1:], dict(kwargs))
            if sampling:
                raise TypeError(f"{self.__name__}(s, ...) writes to the caller's state: sampling "
                                f"defaults {sorted(sampling)} belong to the caller's run")
            return self.func(args[0], **arguments)
        caller = PROGRAM_CALLER.get()
        if caller is None or "backend" in kwargs and caller.honours_backend:
            return self.run(*args, **kwargs)
        return caller.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<lmnb program {self.__name__}({', '.join(self.arg_names)})>"


class _RunningCaller:
    """A running program's body: a program it calls runs on its backend, with its sampling
    defaults under the call's own, in its run (an interrupt aborts both), and has finished
    when the call returns (its error is raised there, as a compiled caller fails with it)."""

    honours_backend = True  # `other(..., backend=b)` inside a running body runs on b

    def __init__(self, backend: Backend, defaults: GenParams, run: ProgramRun) -> None:
        self.backend = backend
        self.defaults = defaults
        self.run = run

    def call(self, program: Program, args: tuple, kwargs: dict[str, Any]) -> ProgramState:
        stream = bool(kwargs.pop("stream", False))
        arguments, sampling = program.split_arguments(args, dict(kwargs))
        defaults = run_defaults({**self.defaults.set_values(), **sampling})
        state = program._execute(self.backend, arguments, defaults, stream, self.run,
                                 nested=True)
        if not stream:
            state.executor.raise_error()
        return state


def _pin_target(backend: Backend) -> Any:
    """What a pin lives in: the runtime under a backend (a new `LocalBackend` may wrap it each
    time), else the backend itself."""
    return backend.runtime if isinstance(backend, LocalBackend) else backend


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@lmnb.function` turns `def f(s, ...)` into a `Program`;
    `@lmnb.function(num_api_spec_tokens=N)` turns on API speculative execution."""
    unknown = set(options) - {"num_api_spec_tokens"}
    if unknown:
        raise TypeError(f"unknown function options {sorted(unknown)}")
    if func is None:
        return lambda f: Program(f, **options)
    return Program(func, **options)
