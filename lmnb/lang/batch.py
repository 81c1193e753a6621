"""`BatchJob`: one `run_batch` (of a `Program` or a `CompiledProgram`), every program a task on
the program loop, started in the waves of `batch_waves.start_waves`: a lead wave spread over the
batch, then the rest together (`global_config.batch_wave` None), or in growing waves.
`BatchRunnable`: `run_batch` and `run_batch_iter` of anything that makes a `BatchJob`."""

from __future__ import annotations

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from lmnb.lang.backends.base import Backend
from lmnb.lang.backends.submit_chunks import whole_turns
from lmnb.lang.batch_waves import start_waves
from lmnb.lang.event_loop import block_on, in_body, program_loop, run_body, wait_queue
from lmnb.lang.gil_share import sharing_the_gil
from lmnb.lang.global_config import global_config
from lmnb.lang.program_run import ProgramRun
from lmnb.lang.program_state import ProgramState
from lmnb.lang.progress import progress_bar as tqdm_bar


def _program_limit(num_threads: int | str, size: int) -> int | None:
    """How many programs of a batch run at once: `num_threads` (SGLang's name), or all of them
    ("auto": they are tasks, and the runtime batches every request it is given)."""
    if num_threads == "auto":
        return None
    return max(1, min(int(num_threads), size))


# Turns of the loop from a wave's start to its gens' submission: the bodies; their executors,
# whose first gens ask for their prompts' ids; those ids, of the whole turn at once
# (`TurnTokens`); the gens' submission.
_WAVE_TURNS = 4


class _BatchRun:
    """The programs of one `run_batch`, as tasks on the program loop: each body runs as a
    greenlet there (`run_body`; a body that reads its state is suspended, not a thread), at most
    `limit` programs at once, and `deliver([(index, state), ...])` is called on the loop once per
    turn with the programs that finished in it (hundreds of programs finishing on one output
    step wake their reader once). `abort()` (any thread) aborts every started program's
    requests; programs not started never start."""

    def __init__(self, execute: Callable[[dict[str, Any], ProgramRun], ProgramState],
                 batch: list[dict[str, Any]], *, limit: int | None,
                 deliver: Callable[[list[tuple[int, ProgramState]]], None]) -> None:
        self.execute = execute
        self.batch = batch
        self.limit = limit
        self.deliver = deliver
        self.runs = _BatchRuns()
        self._finished: list[tuple[int, ProgramState]] = []  # this turn's, not yet delivered

    async def main(self) -> None:
        semaphore = asyncio.Semaphore(self.limit) if self.limit is not None else None
        tasks: list[asyncio.Future[None]] = []
        try:
            # `batch_wave` None: a large batch's lead wave (a few programs spread over it),
            # then the rest. Each wave's bodies run in one turn of the loop, their executors'
            # first gens in the next, tokenized together, sent to the scheduler in one
            # hand-over at the end of the turn that submits them (`whole_turns`): the engine
            # prefills the lead wave while the rest start, and plans its next pass with all of
            # them, as for `generate` of a list of ids. In waves (n): as `Runtime.generate`
            # sends a list of texts, each wave's gens in growing chunks. Either way the
            # scheduler thread shares the GIL with the bodies (`gil_share`).
            wave = global_config.batch_wave
            waves = start_waves(len(self.batch), lead=global_config.batch_lead_wave, wave=wave)
            with sharing_the_gil(global_config.batch_switch_interval), \
                    whole_turns() if wave is None else nullcontext():
                for indices in waves:
                    tasks += [asyncio.ensure_future(self._one(index, self.batch[index],
                                                              semaphore))
                              for index in indices]
                    for _ in range(_WAVE_TURNS):  # after the last: its gens are submitted
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
        # Awaited here, not in the body (whose greenlet has ended): no switch back into it.
        await state.executor.drained()
        self._finished.append((index, state))
        if len(self._finished) == 1:
            asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        finished, self._finished = self._finished, []
        self.deliver(finished)

    def abort(self) -> None:
        self.runs.abort()


_DONE = object()


@dataclass(frozen=True)
class BatchJob:
    """One `run_batch`: `execute(arguments, run)` for every argument dict of `batch`, as tasks on
    the program loop, after caching the programs' shared `prefix` once. `execute` returns the
    program's state as soon as its body has run; the program is done once its executor has
    drained.

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

    def in_order(self, *, num_threads: int | str = "auto",
                 progress_bar: bool = False) -> Iterator[ProgramState]:
        """The states in the batch's order, each once it and every earlier one have finished
        (SGLang's `generator_style`); the batch starts at the first `next`, the progress bar
        counts programs as they finish."""
        results = self._completed(num_threads, progress_bar)
        finished: dict[int, ProgramState] = {}  # finished, waiting for an earlier one
        next_index = 0
        try:
            for index, state in results:
                finished[index] = state
                while next_index in finished:
                    yield finished.pop(next_index)
                    next_index += 1
        finally:
            results.close()  # left early: the programs still running are aborted

    def results(self, *, num_threads: int | str, progress_bar: bool, as_completed: bool,
                generator_style: bool) -> list[ProgramState] | Iterator[ProgramState]:
        """What `run_batch` returns: the states in order; with `as_completed` an iterator in
        the order they finish; with `generator_style` (SGLang's) one in the batch's order."""
        if as_completed and generator_style:
            raise ValueError("run_batch: as_completed yields states as they finish, "
                             "generator_style in the batch's order; pass one of them")
        if as_completed:
            return self.completed(num_threads=num_threads, progress_bar=progress_bar)
        if generator_style:
            return self.in_order(num_threads=num_threads, progress_bar=progress_bar)
        return self.states(num_threads=num_threads, progress_bar=progress_bar)

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
        # A body on the program loop (a nested run_batch) suspends on an asyncio queue: the
        # deliveries come from this very loop, which a blocking get would stop for good.
        nested = in_body()
        finished: queue.SimpleQueue[Any] | asyncio.Queue[Any] = (
            asyncio.Queue() if nested else queue.SimpleQueue())
        put = finished.put_nowait if isinstance(finished, asyncio.Queue) else finished.put
        with (tqdm_bar(total=len(self.batch), desc=self.name) if progress_bar
              else nullcontext()) as bar:
            def deliver(states: list[tuple[int, ProgramState]]) -> None:  # on the loop
                put(states)
                if bar is not None:
                    bar.update(len(states))

            def next_states() -> Any:
                if isinstance(finished, asyncio.Queue):
                    return block_on(finished.get())
                return wait_queue(finished)

            batch_run = _BatchRun(self.execute, self.batch,
                                  limit=_program_limit(num_threads, len(self.batch)),
                                  deliver=deliver)
            future: Future[None] | None = None
            try:
                future = self._start(batch_run)
                future.add_done_callback(
                    lambda _: program_loop().call_soon_threadsafe(put, _DONE))
                while (states := next_states()) is not _DONE:
                    yield from states
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
                              deliver=lambda states: loop.call_soon_threadsafe(
                                  finished.put_nowait, states))
        future: Future[None] | None = None
        try:
            future = await asyncio.to_thread(self._start, batch_run)
            future.add_done_callback(
                lambda _: loop.call_soon_threadsafe(finished.put_nowait, _DONE))
            while (states := await finished.get()) is not _DONE:
                for _, state in states:
                    yield state
            await asyncio.wrap_future(future)  # raises what stopped the batch
        finally:
            if future is None or not future.done() or future.exception() is not None:
                batch_run.abort()
                if future is not None:
                    future.cancel()


BatchArguments = Sequence[dict[str, Any] | Sequence[Any]]  # kwargs dicts or positional tuples


class BatchRunnable(ABC):
    """A program that runs once per item of a batch (`Program`, `CompiledProgram`): it makes
    the `BatchJob`, `run_batch` and `run_batch_iter` run it."""

    @abstractmethod
    def batch_job(self, batch_kwargs: BatchArguments, *, backend: Any,
                  sampling: dict[str, Any]) -> BatchJob:
        """The job of one batch: `sampling` are the defaults of every `gen`."""

    def run_batch(self, batch_kwargs: BatchArguments, *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  as_completed: bool = False, generator_style: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per kwargs dict (or tuple of positional arguments),
        concurrently: every program is a task on one event loop (`num_threads` limits how many
        run at once; "auto": all). The programs' common constant prefix is sent to the
        backend's cache first, so every run hits it. Returns the states in order; with
        `as_completed=True` an iterator of them in the order they finish; with SGLang's
        `generator_style=True` one in the batch's order, each state yielded once it and the
        earlier ones are done. Leaving either iterator early aborts the rest."""
        job = self.batch_job(batch_kwargs, backend=backend, sampling=sampling)
        return job.results(num_threads=num_threads, progress_bar=progress_bar,
                           as_completed=as_completed, generator_style=generator_style)

    def run_batch_iter(self, batch_kwargs: BatchArguments, *, backend: Any = None,
                       num_threads: int | str = "auto",
                       **sampling: Any) -> AsyncIterator[ProgramState]:
        """`run_batch` for asyncio: `async for state in program.run_batch_iter(batch)` yields
        each state as it finishes, from any event loop (a cell's top-level `async for`); the
        programs run on the program loop. Leaving the loop early aborts the rest."""
        job = self.batch_job(batch_kwargs, backend=backend, sampling=sampling)
        return job.aiter_completed(num_threads=num_threads)


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
