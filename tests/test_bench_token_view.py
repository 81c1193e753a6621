"""`bench/token_view.py`'s statistics (the median's interval, the verdict) and its runs on a tiny
runtime: every path draws the same text, the view shows every generated token and accounts its
own CPU time, each runtime thread's CPU is read, the profiler samples the scheduler. No timing."""

from __future__ import annotations

import threading
import time

import pytest

import lmnb
from bench.token_view import (
    ListenerMeter,
    ThreadProfile,
    criterion_line,
    make_program,
    median_interval,
    raw_once,
    run_once,
    spread,
    thread_cpu,
    verdict,
)
from lmnb.lang.backends.local import LocalBackend


def test_median_interval_and_verdict() -> None:
    values = [1.0 + i / 100 for i in range(8)]  # 1.00 .. 1.07
    assert median_interval(values) == (1.01, 1.06)  # 2nd and 7th of 8: P = 1 - 2 * 9/256
    assert median_interval(list(range(20))) == (5, 14)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few: the range
    ok = spread([1.0 + i / 1000 for i in range(8)])
    over = spread([1.1 + i / 1000 for i in range(8)])
    assert (verdict(ok), verdict(over)) == ("OK", "OVER")
    assert verdict(spread([0.9, 1.2, 1.0, 1.1, 0.95, 1.3])) == "UNRESOLVED"
    assert verdict(spread([1.0, 1.01])) == "UNRESOLVED"  # 2 blocks give no 90% interval
    below = [1.0, 1.0, 1.01, 1.02, 1.03, 1.04, 1.049, 1.3]  # the interval: 2nd .. 7th
    assert verdict(spread(below)) == "OK"
    assert verdict(spread([*below[:6], 1.05, 1.3])) == "UNRESOLVED"  # met only below 5%
    assert criterion_line(ok, 10_000).endswith("MET: the 90% CI's top, +0.6%, is below 5%")
    assert "NOT MET" in criterion_line(over, 10_000)
    assert "straddles" in criterion_line(spread([0.9, 1.2, 1.0, 1.1, 0.95, 1.3]), 10_000)
    assert "fewer than the criterion's 10,000" in criterion_line(ok, 640)


def test_runs_of_each_path(tiny_models) -> None:
    pytest.importorskip("anywidget")
    with lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=2048) as runtime:
        backend = LocalBackend(runtime)
        program = make_program(2, 12)
        runs = {mode: run_once(program, runtime, backend, mode, widget=False)
                for mode in ("plain", "traced", "view")}
        assert len({r["text_hash"] for r in runs.values()}) == 1  # same seeds, same text
        assert all(r["tokens"] == 24 and r["forward_passes"] >= 24 for r in runs.values())
        assert runs["traced"]["origin_spans"] >= 2 and "origin_spans" not in runs["plain"]
        view = runs["view"]
        # the last gen's tokens all; the first's up to where the second's prompt re-tokenized
        # its text (random ids seldom re-tokenize the same: those show as prompt tokens)
        assert 12 <= view["shown_generated"] <= 24 and view["flushes"] >= 1
        assert 0 < view["flush_cpu_seconds"] and view["comm_bytes"] > 0
        assert runs["plain"]["thread_cpu_seconds"]["lmnb-scheduler"] > 0
        with ThreadProfile("lmnb-scheduler", interval=0.001) as profile:
            raw = raw_once(runtime, 40)
        assert raw["tokens"] == 40 and raw["chunks"] >= 2
        # the parallel shape: 3 forks of 8 tokens at once, a row each in one view
        forked = make_program(1, 8, forks=3)
        runs = {mode: run_once(forked, runtime, backend, mode, widget=False)
                for mode in ("plain", "view")}
        assert runs["plain"]["text_hash"] == runs["view"]["text_hash"]
        view = runs["view"]
        assert view["tokens"] == 24 and view["rows"] == 4  # the root and its forks
        assert view["shown_generated"] == 24 and 0 <= view["shown_live_share"] <= 1
        assert view["listener_calls"] >= 3 and view["listener_cpu_seconds"] >= 0
        raw = raw_once(runtime, 5, requests=3)
        assert raw["tokens"] == 15 and raw["chunks"] >= 3
    assert profile.samples > 0
    names = [name for name, _ in profile.top(40)]
    assert any(name.endswith(":step") for name in names)


def test_listener_meter_counts_every_call_and_times_some() -> None:
    calls: list[int] = []
    meter = ListenerMeter(lambda: calls.append(1), every=4)
    for _ in range(10):
        meter()
    assert len(calls) == meter.calls == 10 and meter.timed == 2
    assert meter.cpu_seconds == meter.timed_seconds / 2 * 10


def test_thread_cpu_names_threads() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin, name="bench-test-spin", daemon=True)
    worker.start()
    try:
        before = thread_cpu()
        time.sleep(0.05)
        after = thread_cpu()
    finally:
        stop.set()
        worker.join()
    assert after["bench-test-spin"] >= before.get("bench-test-spin", 0.0)
    assert "MainThread" in after and "native" in after
