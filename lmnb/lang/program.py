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
import queue
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmnb.lang.backends.base import Backend
from lmnb.lang.default_backend import as_backend as as_backend
from lmnb.lang.default_backend import default_backend as default_backend
from lmnb.lang.default_backend import set_default_backend as set_default_backend
from lmnb.lang.event_loop import on_loop, program_loop, run_body, wait_queue
from lmnb.lang.interpreter import JoinBranches, Observer, StreamExecutor
from lmnb.lang.ir import (
    GEN_PARAM_NAMES,
    CommitPrefix,
    Expr,
    GenParams,
    join_mode,
)
from lmnb.lang.progress import progress_bar as tqdm_bar
from lmnb.lang.state_writer import PROGRAM_CALLER as PROGRAM_CALLER
from lmnb.lang.state_writer import ProgramStateGroup as ProgramStateGroup
from lmnb.lang.state_writer import StateWriter as StateWriter
from lmnb.params import default_sampling_params
from lmnb.runtime.prompts import chunk_bounds

if TYPE_CHECKING:
    from lmnb.lang.token_trace import TokenTrace

# `run`/`run_batch` keywords that set every gen's default: the gen arguments except those that
# only make sense per gen (a sample count, an output constraint).
SAMPLING_DEFAULT_KEYS = tuple(k for k in GEN_PARAM_NAMES
                              if k not in ("n", "regex", "json_schema", "ebnf"))
# The runtime's own scalar defaults; stop lists stay unset (the chat template may add its own).
RUN_DEFAULTS = GenParams(**{k: v for k, v in default_sampling_params().items()
                            if k in SAMPLING_DEFAULT_KEYS and not isinstance(v, list)})


def batch_defaults(sampling: dict[str, Any]) -> GenParams:
    """`run_batch`'s keyword arguments: sampling defaults only."""
    unknown = sorted(set(sampling) - set(SAMPLING_DEFAULT_KEYS))
    if unknown:
        raise TypeError(f"run_batch got unknown keyword arguments {unknown}")
    return run_defaults(sampling)


def call_arguments(item: Any) -> tuple[tuple, dict[str, Any]]:
    """One `run_batch` item as (positional, keyword) arguments: a dict of keyword arguments or,
    as SGLang accepts, a list or tuple of positional ones."""
    if isinstance(item, list | tuple):
        return tuple(item), {}
    return (), dict(item)


def run_defaults(sampling: dict[str, Any]) -> GenParams:
    values = dict(sampling)
    for key in ("stop", "stop_token_ids"):
        if isinstance(values.get(key), str | int):
            values[key] = (values[key],)
        elif values.get(key) is not None:
            values[key] = tuple(values[key])
    return GenParams(**values).merged_over(RUN_DEFAULTS)


def _program_limit(num_threads: int | str, size: int) -> int | None:
    """How many programs of a batch run at once: `num_threads` (SGLang's name), or all of them
    ("auto": they are tasks, and the runtime batches every request it is given)."""
    if num_threads == "auto":
        return None
    return max(1, min(int(num_threads), size))


_WAVE_TURNS = 2  # turns of the loop between two waves of a batch's programs


class _BatchRun:
    """The programs of one `run_batch`, as tasks on the program loop: each body runs as a
    greenlet there (`run_body`; a body that reads its state is suspended, not a thread), at most
    `limit` programs at once, and `deliver(index, state)` is called on the loop as each one
    finishes. `abort()` (any thread) aborts every started program's requests; programs not
    started never start."""

    def __init__(self, execute: Callable[[dict[str, Any], ProgramRun], ProgramState],
                 batch: list[dict[str, Any]], *, limit: int | None,
                 deliver: Callable[[int, ProgramState], None]) -> None:
        self.execute = execute
        self.batch = batch
        self.limit = limit
        self.deliver = deliver
        self.runs = _BatchRuns()

    async def main(self) -> None:
        semaphore = asyncio.Semaphore(self.limit) if self.limit is not None else None
        tasks: list[asyncio.Future[None]] = []
        try:
            # Programs start in growing waves, as `Runtime.generate` sends a list of prompts in
            # growing chunks: the first wave's gens reach the scheduler after two turns of the
            # loop (bodies, then their executors), and the engine prefills them while the later
            # waves' bodies run.
            for start, end in chunk_bounds(len(self.batch)):
                tasks += [asyncio.ensure_future(self._one(index, self.batch[index], semaphore))
                          for index in range(start, end)]
                if end < len(self.batch):
                    for _ in range(_WAVE_TURNS):
                        await asyncio.sleep(0)
            for task in asyncio.as_completed(tasks):
                await task  # a program's own error is in its state; this is any other
        except BaseException:
            self.abort()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # retrieved: nothing logged
            raise

    async def _one(self, index: int, arguments: dict[str, Any],
                   semaphore: asyncio.Semaphore | None) -> None:
        if semaphore is not None:
            async with semaphore:
                await self._run(index, arguments)
        else:
            await self._run(index, arguments)

    async def _run(self, index: int, arguments: dict[str, Any]) -> None:
        if self.runs.aborted:
            return
        state = await run_body(self.execute, arguments, self.runs.new_run())
        self.deliver(index, state)

    def abort(self) -> None:
        self.runs.abort()


_DONE = object()


@dataclass(frozen=True)
class BatchJob:
    """One `run_batch`: `execute(arguments, run)` for every argument dict of `batch`, as tasks on
    the program loop, after caching the programs' shared `prefix` once.

    `states()` blocks and returns the states in order; `completed()` yields them as they finish;
    `aiter_completed()` does so for an event loop (the kernel's). If the wait is interrupted
    (Ctrl-C), the iteration is left early, or a program fails outside its state, programs not yet
    started never start, every started program's requests are aborted, and the error (if any) is
    raised at once: the programs settle on their own."""

    name: str
    backend: Backend
    prefix: str
    batch: list[dict[str, Any]]
    execute: Callable[[dict[str, Any], ProgramRun], ProgramState]

    def states(self, *, num_threads: int | str = "auto",
               progress_bar: bool = False) -> list[ProgramState]:
        states: list[Any] = [None] * len(self.batch)
        results = self._completed(num_threads, progress_bar)
        try:
            for index, state in results:
                states[index] = state
        finally:
            results.close()  # an interrupt between two states aborts the batch at once
        return states

    def completed(self, *, num_threads: int | str = "auto",
                  progress_bar: bool = False) -> Iterator[ProgramState]:
        """The states in the order they finish (the batch starts at the first `next`)."""
        return (state for _, state in self._completed(num_threads, progress_bar))

    def _start(self, batch_run: _BatchRun) -> Future[None]:
        if self.prefix and len(self.batch) > 1:
            self.backend.cache_prefix(self.prefix)
        return asyncio.run_coroutine_threadsafe(batch_run.main(), program_loop())

    def _completed(self, num_threads: int | str,
                   progress_bar: bool) -> Iterator[tuple[int, ProgramState]]:
        """A generator: nothing starts before its first `next`, and from then on one
        try/finally covers the start too, so an interrupt landing anywhere after the first
        program may have started (e.g. while the batch is being set up on a loaded machine)
        aborts the batch."""
        finished: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with (tqdm_bar(total=len(self.batch), desc=self.name) if progress_bar
              else nullcontext()) as bar:
            def deliver(index: int, state: ProgramState) -> None:
                finished.put((index, state))
                if bar is not None:
                    bar.update(1)

            batch_run = _BatchRun(self.execute, self.batch,
                                  limit=_program_limit(num_threads, len(self.batch)),
                                  deliver=deliver)
            future: Future[None] | None = None
            try:
                future = self._start(batch_run)
                future.add_done_callback(lambda _: finished.put(_DONE))
                while (item := wait_queue(finished)) is not _DONE:
                    yield item
                future.result()  # raises what stopped the batch
            finally:
                if future is None or not future.done() or future.exception() is not None:
                    batch_run.abort()  # left early, failed or interrupted
                    if future is not None:
                        future.cancel()

    async def aiter_completed(self, *, num_threads: int | str = "auto"
                              ) -> AsyncIterator[ProgramState]:
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[Any] = asyncio.Queue()
        batch_run = _BatchRun(self.execute, self.batch,
                              limit=_program_limit(num_threads, len(self.batch)),
                              deliver=lambda _, state: loop.call_soon_threadsafe(
                                  finished.put_nowait, state))
        future: Future[None] | None = None
        try:
            future = await asyncio.to_thread(self._start, batch_run)
            future.add_done_callback(
                lambda _: loop.call_soon_threadsafe(finished.put_nowait, _DONE))
            while (state := await finished.get()) is not _DONE:
                yield state
            await asyncio.wrap_future(future)  # raises what stopped the batch
        finally:
            if future is None or not future.done() or future.exception() is not None:
                batch_run.abort()
                if future is not None:
                    future.cancel()


class _BatchRuns:
    """The runs of one `run_batch`; once aborted, runs made later start aborted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[ProgramRun] = []
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def new_run(self) -> ProgramRun:
        run = ProgramRun()
        with self._lock:
            self._runs.append(run)
            aborted = self._aborted
        if aborted:
            run.abort()
        return run

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            runs = list(self._runs)
        for run in runs:
            run.abort()


class ProgramState(StateWriter):
    """The `s` of a program: `+=` appends (never blocks), `s["var"]` waits for the value."""

    def __init__(self, executor: StreamExecutor, run: ProgramRun | None = None) -> None:
        self._executor = executor
        self._run = run or ProgramRun()
        self._run.add(executor)
        self.ret_value: Any = None
        self._copy_of: ProgramState | None = None  # the parent of `s.copy()`, joined at `with` end
        weakref.finalize(self, executor.close)

    @property
    def executor(self) -> StreamExecutor:
        """This state's executor: its fields (`text_`, `spans`, `variables`, `error`, `idle`)
        are the live view, read without waiting for the program."""
        return self._executor

    @property
    def run(self) -> ProgramRun:
        """Every executor of this program run (this state, its forks and their forks)."""
        return self._run

    # ---- writing -------------------------------------------------------------------------
    def _submit(self, expr: Expr) -> None:
        self._executor.submit(expr)

    # ---- reading -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> Any:
        """The meta info of gen/select `name` once it is done; None if the program sets no such
        variable (as SGLang)."""
        executor = self._executor
        if name not in executor.variables:
            self.sync()
            if name not in executor.variables:
                executor.raise_error()
                return None
        return executor.meta_info.get(name)

    def text(self) -> str:
        return self._executor.text()

    def messages(self) -> list[dict[str, str]]:
        """The roles' messages, each content with its leading whitespace stripped as SGLang's
        (`executor.messages_` keeps them exact: the chat template of those gives `text()`)."""
        self.sync()
        self._executor.raise_error()
        return [{**m, "content": m["content"].lstrip()} if isinstance(m.get("content"), str)
                else dict(m) for m in self._executor.messages_]

    def variables(self) -> dict[str, Any]:
        self.sync()
        self._executor.raise_error()
        return dict(self._executor.variables)

    def spans(self) -> list[tuple[str, int, int]]:
        """(variable, start, end) character spans of generated text in `text()`."""
        self.sync()
        return list(self._executor.spans)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Streams the text of variable `var_name` (or of the whole state) as it is generated."""
        return self._executor.iter_text(var_name)

    def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """`text_iter` for asyncio: `async for chunk in state.text_async_iter("answer")`, from
        any event loop."""
        return self._executor.aiter_text(var_name)

    def error(self) -> BaseException | None:
        self.sync()
        return self._executor.error

    def sync(self) -> None:
        self._run.wait(self._executor.sync)

    # ---- branching -----------------------------------------------------------------------
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` copies of this state. The shared text is sent to the backend's cache once
        before the branches run, so their requests hit it."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        if size > 1:
            self._executor.submit(CommitPrefix())
        self.sync()
        self._executor.raise_error()
        branches = self._executor.fork(size)
        return ProgramStateGroup([ProgramState(b, self._run) for b in branches], parent=self)

    def copy(self) -> ProgramState:
        """One fork of this state. As in SGLang, `with s.copy() as c:` joins it back when the
        block ends (`gather_variable`: its new variables become one-item lists in `s`)."""
        branch = self.fork(1)[0]
        branch._copy_of = self
        return branch

    def __enter__(self) -> ProgramState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._copy_of is not None and exc_info[0] is None:
            self._copy_of.join([self])
        self._executor.close()  # what was submitted still runs; reads keep working

    def join(self, forks: ProgramStateGroup | Sequence[ProgramState],
             mode: str = "gather_variable") -> None:
        """Merges branches: `gather_variable` makes each variable the parent does not have a
        list over branches; `concat_and_append` (or SGLang's `concate_and_append`) appends each
        branch's new text in order."""
        branches = tuple(state.executor for state in forks)
        self._executor.submit(JoinBranches(branches, join_mode(mode)))

    def abort(self) -> None:
        self._run.abort()

    @property
    def token_trace(self) -> TokenTrace | None:
        """This state's recorded tokens when its run was traced (`run(..., token_view=True)`,
        `%%lmprogram --tokens`), else None."""
        return self._executor.token_trace

    def token_view(self, **options: Any) -> Any:
        """A `lmnb.widgets.TokenView` of this state's run (its forks one row each), live while
        it runs; the run must have been traced (`run(..., token_view=True)`)."""
        from lmnb.widgets.token_view import TokenView

        return TokenView(self, **options)

    def observe(self, observer: Observer | None) -> None:
        """Calls `observer(kind, executor, data)` on this run's events (text deltas, finished
        variables, forks, errors) from the program loop; used by live widgets."""
        self._run.observe(observer)

    @property
    def state_id(self) -> int:
        return self._executor.id

    @property
    def idle(self) -> bool:
        return self._executor.idle

    def __repr__(self) -> str:
        """SGLang's form, `ProgramState(<text>)`; the text so far while the program runs (a
        repr never waits)."""
        return f"ProgramState({self._executor.text_})"


class ProgramRun:
    """Every executor of one program run (root state and forks), so that an interrupt aborts
    them all. Once aborted, executors added later (forks) are aborted as they are added."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executors: list[StreamExecutor] = []
        self._observer: Observer | None = None
        self._aborted = False

    @property
    def executors(self) -> tuple[StreamExecutor, ...]:
        with self._lock:
            return tuple(self._executors)

    @property
    def observer(self) -> Observer | None:
        return self._observer

    @property
    def aborted(self) -> bool:
        return self._aborted

    def observe(self, observer: Observer | None) -> None:
        with self._lock:
            self._observer = observer
            executors = list(self._executors)
        for executor in executors:
            executor.observer = observer

    def add(self, executor: StreamExecutor) -> None:
        with self._lock:
            if self._observer is not None:
                executor.observer = self._observer
            self._executors.append(executor)
            aborted = self._aborted
        if aborted:
            executor.abort()

    def abort(self) -> None:
        """Interrupts every executor's running request and drops what is queued."""
        with self._lock:
            self._aborted = True
            executors = list(self._executors)
        for executor in executors:
            executor.abort()

    def settle(self) -> None:
        """Waits until every executor has stopped running (after `abort`, promptly)."""
        for executor in self.executors:
            executor.sync()

    def wait(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except KeyboardInterrupt:
            self.abort()
            self.settle()
            raise


class Program:
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
        self._pins: dict[Any, tuple[Backend, Any]] = {}  # pinned prefix per runtime (`pin`)
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__} has no arguments {sorted(unknown)}")
        return Program(self.func, {**self.bound, **kwargs},
                       num_api_spec_tokens=self.num_api_spec_tokens)

    def split_arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict, dict]:
        """(program arguments, sampling defaults) of a call's arguments."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in SAMPLING_DEFAULT_KEYS}
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
                 raise_body_error: bool = True, token_view: bool = False) -> ProgramState:
        executor = StreamExecutor(backend, defaults=defaults, stream=stream,
                                  num_api_spec_tokens=self.num_api_spec_tokens)
        if token_view:
            from lmnb.lang.token_trace import start_trace

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
            # Nothing more runs. The error's frames hold `s`: a live worker would keep it forever.
            executor.close()
            if not stream and raise_body_error:
                raise
        finally:
            PROGRAM_CALLER.reset(caller)
        if not stream:
            state.sync()
        return state

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]], *,
                  backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, as_completed: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per kwargs dict (or tuple of positional arguments),
        concurrently: every program is a task on one event loop (`num_threads` limits how many
        run at once; "auto": all). The programs' common constant prefix is sent to the
        backend's cache first, so every run hits it. Returns the states in order, or with
        `as_completed=True` an iterator of them in the order they finish (leaving it early
        aborts the rest)."""
        job = self.batch_job(batch_kwargs, backend=backend, sampling=sampling)
        if as_completed:
            return job.completed(num_threads=num_threads, progress_bar=progress_bar)
        return job.states(num_threads=num_threads, progress_bar=progress_bar)

    def run_batch_iter(self, batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]], *,
                       backend: Any = None, num_threads: int | str = "auto",
                       **sampling: Any) -> AsyncIterator[ProgramState]:
        """`run_batch` for asyncio: `async for state in program.run_batch_iter(batch)` yields
        each state as it finishes, from any event loop (a cell's top-level `async for`); the
        programs run on the program loop. Leaving the loop early aborts the rest."""
        job = self.batch_job(batch_kwargs, backend=backend, sampling=sampling)
        return job.aiter_completed(num_threads=num_threads)

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

    def batch_job(self, batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]], *,
                  backend: Any, sampling: dict[str, Any]) -> BatchJob:
        backend = as_backend(backend)
        defaults = batch_defaults(sampling)
        batch = [self.split_arguments(*call_arguments(item))[0] for item in batch_kwargs]
        from lmnb.lang.global_config import global_config
        from lmnb.lang.tracer import constant_prefix

        precache = global_config.enable_precache_with_tracing and len(batch) > 1
        prefix = constant_prefix(self, backend) if precache else ""
        return BatchJob(self.__name__, backend, prefix, batch,
                        lambda arguments, run: self._execute(backend, arguments, defaults,
                                                             stream=False, run=run,
                                                             raise_body_error=False))

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """The program as an IR graph; unbound arguments stay symbolic. The graph does not
        depend on a backend (`backend` is accepted as in SGLang)."""
        del backend
        from lmnb.lang.tracer import trace_program

        return trace_program(self, {**self.bound, **kwargs})

    def compile(self, *, backend: Any = None) -> Any:
        """A graph-executed version of the program (no data-dependent control flow); the backend
        is chosen when it runs (`backend` is accepted as in SGLang)."""
        del backend
        from lmnb.lang.compiler import CompiledProgram

        return CompiledProgram(self)

    def cache(self, backend: Any = None) -> str:
        """SGLang's `cache`: sends the text every run of the program starts with (its constant
        prefix, found by tracing) to the backend's prefix cache; returns that text."""
        from lmnb.lang.tracer import constant_prefix

        backend = as_backend(backend)
        prefix = constant_prefix(self, backend)
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    def pin(self, backend: Any = None) -> str:
        """SGLang's `pin`: caches the program's constant prefix (as `cache`) and keeps it in the
        backend's cache until `unpin()`: the runtime's evictions skip it. Once per backend;
        returns the prefix. A backend that cannot pin (no `pin_prefix`) only caches it."""
        from lmnb.lang.tracer import constant_prefix

        backend = as_backend(backend)
        prefix = constant_prefix(self, backend)
        target = _pin_target(backend)
        if not prefix or target in self._pins:
            return prefix
        pin_prefix = getattr(backend, "pin_prefix", None)
        if pin_prefix is None:
            warnings.warn(f"{type(backend).__name__} cannot pin a prefix; {self.__name__}'s "
                          f"prefix is cached, and may be evicted", stacklevel=2)
            backend.cache_prefix(prefix)
            return prefix
        self._pins[target] = (backend, pin_prefix(prefix))
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
        state = program._execute(self.backend, arguments, defaults, stream, self.run)
        if not stream:
            state.executor.raise_error()
        return state


def _pin_target(backend: Backend) -> Any:
    """What a pin lives in: the runtime under a backend (a new `LocalBackend` may wrap it each
    time), else the backend itself."""
    return getattr(backend, "runtime", backend)


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@lmnb.function` turns `def f(s, ...)` into a `Program`;
    `@lmnb.function(num_api_spec_tokens=N)` turns on API speculative execution."""
    unknown = set(options) - {"num_api_spec_tokens"}
    if unknown:
        raise TypeError(f"unknown function options {sorted(unknown)}")
    if func is None:
        return lambda f: Program(f, **options)
    return Program(func, **options)
