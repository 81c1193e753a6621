"""The scheduler's thread: a thin loop around `Scheduler.step()`. Other threads talk to it only
through an inbox (submit, abort by id, call a function between steps, stop). Before each step it
drains the whole inbox, so requests submitted together (`submit_many`: one message) are planned
together."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lmnb.runtime.scheduler.request_state import ReqState
from lmnb.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerThread:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.fatal_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="lmnb-scheduler", daemon=True)
        self._thread.start()

    # ---- other threads -------------------------------------------------------------------------
    def submit(self, state: ReqState) -> None:
        self._inbox.put(("add", state))

    def submit_many(self, states: list[ReqState]) -> None:
        """Submits `states` as one message: the scheduler sees all of them or none before it
        plans a pass."""
        if states:
            self._inbox.put(("add_many", states))

    def abort(self, rid: int, message: str = "aborted") -> None:
        self._inbox.put(("abort", (rid, message)))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the scheduler thread between steps and returns its result."""
        if self._stopped.is_set():
            raise RuntimeError("the runtime is closed")
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                if not self._thread.is_alive() and not future.done():
                    raise RuntimeError("the runtime is closed") from None

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join()

    # ---- the thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        scheduler = self.scheduler
        while not self._stopped.is_set():
            self._drain(block=not scheduler.has_work)
            if self._stopped.is_set():
                break
            try:
                worked = scheduler.step()
            except BaseException as error:  # keep serving; never leave callers hanging
                logger.exception("scheduler step failed")
                self.fatal_error = error
                scheduler.abort_all(f"scheduler error: {error!r}")
                continue
            if not worked and scheduler.has_work:
                self._drain(block=True)  # nothing schedulable now: wait for news
        scheduler.abort_all("the runtime was closed")
        self._refuse_pending()

    def _refuse_pending(self) -> None:
        """Messages that raced with `stop` fail instead of waiting forever."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                payload[1].set_exception(RuntimeError("the runtime is closed"))
            elif kind in ("add", "add_many"):
                for state in payload if kind == "add_many" else [payload]:
                    self.scheduler.add(state)
                    self.scheduler.abort(state.rid, "the runtime was closed")

    def _drain(self, *, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self.scheduler.add(payload)
        elif kind == "add_many":
            for state in payload:
                self.scheduler.add(state)
        elif kind == "abort":
            self.scheduler.abort(*payload)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)
