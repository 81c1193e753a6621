"""A daemon thread that polls a source until told to stop or the source goes away."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from lmnb.widgets.saved_text import SavedText

_log = logging.getLogger(__name__)

T = TypeVar("T")


class Poller:
    """Calls `poll()` every `interval_s` seconds on a daemon thread until `stop()` or until
    `poll()` returns False (its source is gone, e.g. a closed Runtime)."""

    def __init__(self, poll: Callable[[], bool], *, interval_s: float) -> None:
        if interval_s < 1 / 30:
            raise ValueError(f"interval_s must be at least 1/30 s, got {interval_s}")
        self._poll = poll
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lmnb-widget-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self._poll():
                    return
            except Exception:
                _log.exception("widget poll failed")
                return


class PolledRuntime(Protocol):
    """What the polling widgets ask of a Runtime besides its readers."""

    @property
    def closed(self) -> bool: ...

    @property
    def failed(self) -> bool: ...


def runtime_gone(runtime: PolledRuntime) -> bool:
    """Whether a Runtime that raised RuntimeError is closed or failed for good (else the error
    was passing and polling goes on)."""
    return runtime.closed or runtime.failed


class PollingWidget:
    """Mixin for widgets that poll a Runtime and show `self.status`: `start_polling()` calls their
    `_poll()` on a `Poller` (`self._poller`, or None), which reads through `read_runtime()`;
    `close()` stops polling and lets go of the runtime."""

    _poller: Poller | None = None  # None until `start_polling` (and without a thread)
    _runtime: PolledRuntime | None
    status: str

    def start_polling(self, interval_s: float | None) -> None:
        """Calls `_poll()` every `interval_s` seconds on a daemon thread until it returns False
        or polling stops; None, or no runtime: no thread (`refresh()` reads on demand)."""
        self._poller = None
        if interval_s is not None and self._runtime is not None:
            self._poller = Poller(self._poll, interval_s=interval_s)
            self._poller.start()

    def _poll(self) -> bool:
        """Reads the runtime and updates the view; False once the runtime is gone."""
        raise NotImplementedError

    def read_runtime(self, read: Callable[[Any], T]) -> T | None:
        """`read(runtime)`, or None when there is nothing to read: no runtime, or it raised a
        RuntimeError. If that runtime is closed or failed for good, the widget lets go of it and
        shows it stopped (`_runtime` is None after); else the error was passing and the next
        poll reads again."""
        runtime = self._runtime
        if runtime is None:
            return None
        try:
            return read(runtime)
        except RuntimeError:
            if runtime_gone(runtime):
                self._runtime = None
                self.status = "stopped: the runtime is closed"
            return None

    def stop_polling(self, status: str) -> None:
        """Stops polling, keeping what the widget shows, with `status` (why) if it was live."""
        if self._poller is not None:
            self._poller.stop()
        if self.status == "live":
            self.status = status
        if isinstance(self, SavedText):
            self.update_saved_text()

    def close(self) -> None:
        """Stops polling and lets go of the runtime."""
        self.stop_polling("stopped")
        self._runtime = None
        super().close()  # type: ignore[misc]

    @property
    def polling(self) -> bool:
        return self._poller is not None and self._poller.alive
