"""Programs inside programs and forks: a run_batch called by a body that runs on the program loop
(a batch's or arun's), fork branches under API speculation, and a body that fails with a gen in
flight."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

import lmnb
import lmnb.lang.event_loop
from lmnb import gen
from lmnb.lang.backends.base import Generation
from lmnb.lang.ir import GenParams
from tests.fake_backend import TextOnlyFake
from tests.test_dsl_rewritten_variables import CountingBackend, with_timeout

# Run in a subprocess: the deadlock blocks the process's one program loop for good, which would
# hang every later test.
_NESTED = """
import asyncio, sys
import lmnb
from lmnb import gen
from tests.test_dsl_rewritten_variables import CountingBackend
backend = CountingBackend()

@lmnb.function
def inner(s, q):
    s += q + gen("a", max_tokens=2)

@lmnb.function
def outer(s, q):
    states = inner.run_batch([{"q": q + "1"}, {"q": q + "2"}], backend=backend)
    s += states[0]["a"] + states[1]["a"]

if sys.argv[1] == "batch":
    states = outer.run_batch([{"q": "x"}, {"q": "y"}], backend=backend)
    assert all(st.error() is None for st in states)
else:
    assert asyncio.run(outer.arun("x", backend=backend)).error() is None
print("ok")
"""


@pytest.mark.parametrize("how", ["batch", "arun"])
def test_run_batch_inside_a_body_on_the_program_loop_does_not_hang(how):
    # outer's bodies run as greenlets on the program loop (run_batch, arun); inner.run_batch
    # suspends the body until its deliveries (it once blocked the loop that makes them).
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run([sys.executable, "-c", _NESTED, how], cwd=root, timeout=20,
                             capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{how}: a program body calling run_batch deadlocked the program loop")
    assert "ok" in out.stdout, out.stderr[-2000:]



class SpeculatingBackend(TextOnlyFake):
    """Each call's text is unique: "r<k>\\ns<k>\\nt<k>" (a sampled continuation)."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = itertools.count(1)
        self.prompts: list[str] = []

    async def agenerate(self, prompt: str, params: GenParams, **extra: Any) -> Generation:
        k = next(self.counter)
        self.prompts.append(prompt)
        text = f"r{k}\ns{k}\nt{k}"
        if params.stop:  # a real (non-speculative) call stops at its stop
            text = text.split("\n")[0]
        return Generation(text, {"finish_reason": {"type": "length"}, "completion_tokens": 6})

    async def aselect(self, *args: Any, **kwargs: Any) -> tuple[str, dict]:
        raise AssertionError

    async def acache_prefix(self, prompt: str, **extra: Any) -> None:
        pass

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise AssertionError

    def select(self, *args: Any, **kwargs: Any) -> tuple[str, dict]:
        raise AssertionError


def test_fork_branches_do_not_all_take_the_parents_speculated_sample():
    @lmnb.function(num_api_spec_tokens=32)
    def sampled(s):
        s += "Q:" + gen("a", stop="\n", max_tokens=16, temperature=1.0)
        forks = s.fork(3)
        forks += "\n" + gen("b", stop="\n", max_tokens=16, temperature=1.0)
        forks.join()

    state = sampled.run(backend=SpeculatingBackend())
    # three independent samples were asked for: the parent's speculated "s1" is one of them
    assert state["b"] != ["s1", "s1", "s1"]


def _aborted_within(backend: CountingBackend, seconds: float = 10.0, count: int = 1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if backend.aborted >= count:
            return True
        time.sleep(0.02)
    return False


def _release(backend: CountingBackend) -> None:
    loop_ = lmnb.lang.event_loop.program_loop()
    loop_.call_soon_threadsafe(lambda: backend.release and backend.release.set())


def test_a_body_error_aborts_the_gen_in_flight():
    backend = CountingBackend(hold_word="hold")

    @lmnb.function
    def p(s):
        s += "hold " + gen("a", max_tokens=2)
        while backend.held == 0:  # the gen is in flight
            time.sleep(0.01)
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError):
            with_timeout(lambda: p.run(backend=backend))
        assert _aborted_within(backend), "run() raised; its request keeps running (KV held)"
    finally:
        _release(backend)


def test_a_body_error_aborts_the_forks_gens_in_flight():
    backend = CountingBackend(hold_word="hold")

    @lmnb.function
    def p(s):
        forks = s.fork(2)
        forks += "hold " + gen("a", max_tokens=2)
        while backend.held < 2:  # both branches' gens are in flight
            time.sleep(0.01)
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError):
            with_timeout(lambda: p.run(backend=backend))
        assert _aborted_within(backend, count=2), "the branches' requests keep running"
    finally:
        _release(backend)


class FailingBackend(CountingBackend):
    async def agenerate(self, prompt: str, params: GenParams, **kwargs: Any) -> Generation:
        if "fail" in prompt:
            raise RuntimeError("backend failed")
        return await super().agenerate(prompt, params, **kwargs)


def test_a_branch_failure_aborts_the_siblings_request():
    backend = FailingBackend(hold_word="hold")

    @lmnb.function
    def f(s):
        s += "start "
        forks = s.fork(2)
        forks[0] += "fail " + gen("x", max_tokens=2)
        forks[1] += "hold " + gen("x", max_tokens=2)
        forks.join()

    state = with_timeout(lambda: f.run(backend=backend))
    try:
        assert state.error() is not None  # the run has failed and returned ...
        assert _aborted_within(backend), "... while its other branch's request still runs"
    finally:
        _release(backend)
