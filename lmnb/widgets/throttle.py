"""Coalesces updates from engine and program threads into calls at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

_log = logging.getLogger(__name__)


class Throttle:
    """Calls `flush()` on a daemon thread at most `hz` times a second after `request()`.

    Requests made while a flush is pending or running are merged into the next one. `flush`
    returns True to be called again (e.g. while something still runs). The thread ends after
    `idle_s` without requests and starts again on the next one.

    A request while one is pending costs one flag read, no lock (a traced program requests on
    every streamed token): the flag is set only while a thread lives that will clear it and
    then flush, so that flush sees what the request announced.
    """

    def __init__(self, flush: Callable[[], bool], *, hz: float = 20.0, idle_s: float = 2.0) -> None:
        if not 0 < hz <= 100:
            raise ValueError(f"hz must be in (0, 100], got {hz}")
        self._flush = flush
        self._period = 1.0 / hz
        self._idle_s = idle_s
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def request(self) -> None:
        if self._wake.is_set():  # pending: the next flush covers this request
            return
        with self._lock:
            if self._stopped:
                return
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lmnb-widget", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._idle_s)
            with self._lock:  # a request set the flag, under this lock, or it is idle
                if self._stopped or not self._wake.is_set():
                    self._thread = None
                    return
                self._wake.clear()
            try:
                again = self._flush()
            except Exception:  # a broken display must not kill its updater
                _log.exception("widget update failed")
                again = False
            if again:
                self._wake.set()
            time.sleep(self._period)  # requests arriving now coalesce into the next flush
