"""`Throttle`: requests made while a flush is pending or running coalesce into one flush that sees
them, a request is never lost when the idle thread ends as it arrives, and `stop` ends it. No
timing asserts: waits are for events, with generous timeouts."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lmnb.widgets.throttle import Throttle

TIMEOUT = 10.0


def test_requests_while_pending_coalesce_into_one_flush_that_sees_them() -> None:
    value = [0]
    seen: list[int] = []
    started, release = threading.Event(), threading.Event()
    flushed = [threading.Event() for _ in range(3)]

    def flush() -> bool:
        if not seen:
            started.set()
            assert release.wait(TIMEOUT)  # the first flush runs while the requests come
        seen.append(value[0])
        flushed[len(seen) - 1].set()
        return False

    throttle = Throttle(flush, hz=100, idle_s=0.05)
    throttle.request()
    assert started.wait(TIMEOUT)
    for i in range(1, 1001):  # a traced program's token events
        value[0] = i
        throttle.request()
    release.set()
    assert flushed[1].wait(TIMEOUT)
    value[0] = 1001
    throttle.request()  # after the idle thread ended, or into its next turn
    assert flushed[2].wait(TIMEOUT)
    throttle.stop()
    assert seen[1:] == [1000, 1001]  # the 1,000 requests: one flush, of the last value


class RacyEvent(threading.Event):
    """An event whose next timed-out wait runs `hook` before it returns: a request that lands
    after the idle thread's wait ran out and before that thread gives up."""

    hook: Callable[[], None] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(timeout)
        hook, RacyEvent.hook = RacyEvent.hook, None
        if not woke and hook is not None:
            hook()
        return woke


def test_a_request_as_the_idle_thread_ends_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    value, seen = [0], [-1]
    changed = threading.Condition()

    def flush() -> bool:
        with changed:
            seen[0] = value[0]
            changed.notify_all()
        return False

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Event", RacyEvent)
        throttle = Throttle(flush, hz=100, idle_s=0.02)
    try:
        throttle.request()
        with changed:
            assert changed.wait_for(lambda: seen[0] == 0, TIMEOUT)

        def late_request() -> None:
            value[0] = 1
            throttle.request()

        RacyEvent.hook = late_request
        with changed:
            assert changed.wait_for(lambda: seen[0] == 1, TIMEOUT), "the late request was lost"
        assert RacyEvent.hook is None  # it ran
    finally:
        throttle.stop()


def test_stop_ends_the_flushes() -> None:
    calls = [0]
    first = threading.Event()

    def flush() -> bool:
        calls[0] += 1
        first.set()
        return True  # again and again, until stopped

    throttle = Throttle(flush, hz=100)
    throttle.request()
    assert first.wait(TIMEOUT)
    throttle.stop()
    threading.Event().wait(0.05)
    stopped_at = calls[0]
    throttle.request()
    threading.Event().wait(0.05)
    assert calls[0] <= stopped_at + 1  # at most the flush that was running
