"""Ctrl-C while `run_batch` waits: every program's requests are aborted, programs not started
never start, and `run_batch` raises at once without waiting for the program threads.

Deterministic: the backend's `generate` can only end once its request is cancelled, and the
main thread is interrupted (`_thread.interrupt_main`) only after every program that can start
has started, so `run_batch` is provably still waiting when the interrupt lands. Timeouts below
only bound a failing test; no assertion depends on a sleep being long enough."""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable

import pytest

import lmnb
from lmnb import gen
from lmnb.lang.backends.base import Backend, Generation, ProgramAborted
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.ir import GenParams
from lmnb.lang.program import ProgramRun
from tests.fake_backend import TextOnlyFake

GUARD_S = 60.0  # only reached when the behaviour under test is broken


class BlockingBackend(TextOnlyFake):
    """`generate` blocks until its request is cancelled, then until the test `release`s it.
    When `expected` calls have arrived, it interrupts the main thread."""

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.expected = expected
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.timed_out: list[str] = []
        self.finished = threading.Event()
        self.release = threading.Event()

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        assert cancel is not None
        with self.lock:
            self.started.append(prompt)
            if len(self.started) == self.expected:
                _thread.interrupt_main()
        cancelled = cancel.wait(GUARD_S)
        # Holds the program thread after its abort: a run_batch that waited for program
        # threads could not return before the test sets `release`.
        released = self.release.wait(GUARD_S)
        with self.lock:
            if cancelled:
                self.cancelled.append(prompt)
            if not released:
                self.timed_out.append(prompt)
            if len(self.cancelled) + len(self.timed_out) >= self.expected:
                self.finished.set()
        raise ProgramAborted("cancelled")

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        raise AssertionError("no select here")

    def cache_prefix(self, prompt: str) -> None:
        pass


def test_blocking_backend_implements_the_protocol():
    assert isinstance(BlockingBackend(1), Backend)


@pytest.mark.parametrize("compiled", [False, True])
def test_interrupted_run_batch_aborts_every_program_and_returns_at_once(compiled, default_sigint):
    backend = BlockingBackend(expected=2)

    @lmnb.function
    def ask(s, i):
        s += "question " + i + ": " + gen("answer", max_tokens=8)

    program = ask.compile() if compiled else ask
    with pytest.raises(KeyboardInterrupt):
        program.run_batch([{"i": str(i)} for i in range(5)], backend=backend, num_threads=2,
                          progress_bar=False)
    backend.release.set()  # run_batch returned while both program threads were still held
    assert backend.finished.wait(GUARD_S)
    assert backend.timed_out == []
    assert sorted(backend.started) == sorted(backend.cancelled)
    assert len(backend.started) == 2  # the 3 programs not started never ran


def test_a_run_aborted_before_a_fork_aborts_the_fork():
    run = ProgramRun()
    run.abort()
    backend = BlockingBackend(expected=1)
    executor = StreamExecutor(backend, defaults=GenParams())
    run.add(executor)
    executor.submit(gen("x"))
    executor.sync()
    assert isinstance(executor.error, ProgramAborted)
    assert backend.started == []  # aborted before its request was sent
    assert run.executors == (executor,)


def test_a_simulated_ctrl_c_is_not_lost_in_a_finalizer(default_sigint):
    """The tests' SIGINT handler (conftest) re-arms an interrupt that arrives while a `__del__`
    (or a weakref callback) runs, where Python would swallow the KeyboardInterrupt: it lands
    once the finalizer has returned."""
    ran = []

    class Dropped:
        def __del__(self) -> None:
            _thread.interrupt_main()  # arrives while the finalizer runs
            for i in range(1000):  # the interpreter checks for signals in here
                ran.append(i)

    deadline = time.monotonic() + GUARD_S
    with pytest.raises(KeyboardInterrupt):
        Dropped()  # dropped at once: its __del__ runs here
        while time.monotonic() < deadline:  # ... and the interrupt lands here, in the test
            pass
    assert len(ran) == 1000  # the finalizer was not cut short either
