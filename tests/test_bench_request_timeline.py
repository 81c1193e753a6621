"""`bench/request_timeline.py` (the DSL and raw paths' steps up to the first forward pass) and
`bench/dsl_overhead.py`'s profiles, on the shared tiny runtime: counts and order, no timing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lmnb
from bench.dsl_overhead import profiled_threads, top_table
from bench.request_timeline import STEPS, RequestTimeline, timeline_rows
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.program import Program
from lmnb.runtime.engine import Runtime
from lmnb.runtime.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[lmnb.Runtime]:
    runtime = lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=4096)
    yield runtime
    runtime.close()


@lmnb.function
def answer(s, question):  # no constant prefix: no cache hint before the programs
    s += question + "\nA:" + lmnb.gen("a", max_tokens=2, temperature=0)


def test_timeline_of_a_run_batch_and_of_a_raw_generate(rt):
    originals = (Program.batch_job, LocalBackend.agenerate, Runtime.generate, Scheduler.add)
    timeline = RequestTimeline()
    summaries = {}
    for label in ("dsl", "raw"):
        assert rt.flush_cache()
        rt.set_batch_hook(timeline.batch_hook())
        try:
            with timeline.recording():
                timeline.restart()
                if label == "dsl":
                    states = answer.run_batch([{"question": f"q{i}"} for i in range(5)],
                                              backend=LocalBackend(rt))
                    assert all(isinstance(state["a"], str) for state in states)
                else:
                    rt.generate([f"q{i}\nA:" for i in range(5)], {"max_new_tokens": 2})
        finally:
            rt.set_batch_hook(None)
        summaries[label] = timeline.summary()
    assert (Program.batch_job, LocalBackend.agenerate, Runtime.generate,
            Scheduler.add) == originals  # restored

    dsl, raw = summaries["dsl"], summaries["raw"]
    assert set(dsl) == {*STEPS, "thread_cpu_s_to_first_pass"}
    for step in ("body_started", "gen_submitted", "generate_called", "sent_to_scheduler",
                 "added_to_waiting"):
        assert dsl[step]["count"] == 5, step
    firsts = [dsl[step]["first"] for step in STEPS]
    assert firsts == sorted(firsts)  # each step's first time follows the previous step's
    assert dsl["pass_launch_started"]["count"] == dsl["pass_ended"]["count"] >= 2
    assert "lmnb-scheduler" in dsl["thread_cpu_s_to_first_pass"]
    assert "body_started" not in raw and raw["generate_called"]["count"] == 1
    assert raw["sent_to_scheduler"]["count"] == raw["added_to_waiting"]["count"] == 5
    rows = timeline_rows(summaries)
    assert [row[:2] for row in rows] == [("dsl", "first"), ("dsl", "last"), ("raw", "first"),
                                         ("raw", "last")]
    assert rows[2][2] == "-" and len(rows[0]) == 2 + len(STEPS)


@pytest.mark.parametrize("all_threads_at_once", [False, True])
def test_profile_of_a_run_batch(rt, all_threads_at_once):
    """Per thread (Python < 3.12) or one profile for every thread (3.12's `sys.monitoring`
    allows one at a time): either gives the tables."""
    backend = LocalBackend(rt)
    answer.run(question="warm", backend=backend)  # the program loop exists
    with profiled_threads(True, all_threads_at_once=all_threads_at_once) as profiles:
        answer.run_batch([{"question": f"q{i}"} for i in range(3)], backend=backend)
    assert len(profiles) == 1 if all_threads_at_once else len(profiles) >= 2
    assert "run_batch" in top_table(profiles, "cumulative", 40)
