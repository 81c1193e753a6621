"""`ProgramRun`: every executor of one program run (the root state and its forks), so that an
interrupt aborts them all."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lmnb.lang.interpreter import Observer, StreamExecutor


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
