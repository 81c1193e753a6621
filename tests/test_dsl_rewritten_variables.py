"""A variable written again by a later gen (in a loop, or in a fork that inherited it) is read
only once its new value is final: SGLang resets a variable's event on every submit."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmnb
import lmnb.lang.event_loop
from lmnb import gen
from lmnb.lang.backends.base import Generation, ProgramAborted
from lmnb.lang.ir import GenParams
from tests.fake_backend import TextOnlyFake

GUARD_S = 10.0


class CountingBackend(TextOnlyFake):
    """An AsyncBackend replying "r1", "r2", ... in call order; gens whose prompt contains
    `hold_word` wait on an asyncio event the test opens."""

    def __init__(self, hold_word: str | None = None) -> None:
        super().__init__()
        self.counter = itertools.count(1)
        self.hold_word = hold_word
        self.held = 0
        self.aborted = 0
        self.release: asyncio.Event | None = None

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        cancel: threading.Event | None = None, **extra: Any) -> Generation:
        text = f"r{next(self.counter)}"
        if self.hold_word is not None and self.hold_word in prompt:
            if self.release is None:
                self.release = asyncio.Event()
            self.held += 1
            try:
                while not self.release.is_set():
                    if cancel is not None and cancel.is_set():
                        self.aborted += 1
                        raise ProgramAborted("the program was interrupted")
                    await asyncio.sleep(0.01)
            finally:
                self.held -= 1
        if on_delta is not None:
            on_delta(text)
        return Generation(text, {"finish_reason": {"type": "stop"}})

    async def aselect(self, prompt: str, choices: tuple[str, ...], method: str,
                      **extra: Any) -> tuple[str, dict]:
        return choices[0], {}

    async def acache_prefix(self, prompt: str, **extra: Any) -> None:
        pass

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise AssertionError("the program loop awaits agenerate")

    def select(self, *args: Any, **kwargs: Any) -> tuple[str, dict]:
        raise AssertionError("the program loop awaits aselect")


def with_timeout(fn: Callable[[], Any], timeout: float = GUARD_S) -> Any:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=timeout)
    finally:
        pool.shutdown(wait=False)


def release_once_held(backend: CountingBackend) -> None:
    """Opens the held gen, on the loop, once it is held and a moment has passed (a read that
    does not wait for it returns in that moment)."""
    import time
    deadline = time.monotonic() + GUARD_S
    while backend.held == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    loop_ = lmnb.lang.event_loop.program_loop()
    loop_.call_soon_threadsafe(lambda: backend.release and backend.release.set())


def test_reading_a_variable_that_a_later_gen_rewrites_waits_for_the_new_value():
    backend = CountingBackend(hold_word="r1")  # the second gen's prompt holds "r1"

    @lmnb.function
    def loop(s):
        seen = []
        for _ in range(2):
            s += "Q: " + gen("x", max_tokens=4) + "\n"
            seen.append(s["x"])
        return seen

    def release_later() -> None:
        release_once_held(backend)

    threading.Thread(target=release_later, daemon=True).start()
    state = with_timeout(lambda: loop.run(backend=backend))
    # As SGLang (each submitted gen resets the variable's event): each read sees its own gen;
    # here the second read returns the first gen's "r1" while the second gen is still held.
    assert state.ret_value == ["r1", "r2"]


# ---- a fork reading a variable it inherited and generates again
def test_a_fork_reading_a_variable_it_generates_again_waits_for_its_own_value():
    backend = CountingBackend(hold_word="A: r1")  # the branch's gen is held

    @lmnb.function
    def tree(s):
        s += "A: " + gen("x", max_tokens=4) + "\n"
        s["x"]
        branch = s.fork(1)[0]
        branch += "B: " + gen("x", max_tokens=4)
        return branch["x"]

    def release_later() -> None:
        release_once_held(backend)

    threading.Thread(target=release_later, daemon=True).start()
    state = with_timeout(lambda: tree.run(backend=backend))
    assert state.ret_value == "r2"  # got the parent's "r1" while the branch's gen was held


def test_meta_info_of_a_variable_a_later_gen_rewrites_waits_for_the_new_gen():
    class MetaBackend(CountingBackend):
        async def agenerate(self, prompt: str, params: GenParams, **extra: Any) -> Generation:
            generation = await super().agenerate(prompt, params, **extra)
            return Generation(generation.text, {"reply": generation.text})

    backend = MetaBackend(hold_word="r1")

    @lmnb.function
    def loop(s):
        seen = []
        for _ in range(2):
            s += "Q: " + gen("x", max_tokens=4) + "\n"
            seen.append(s.get_meta_info("x")["reply"])
        return seen

    threading.Thread(target=lambda: release_once_held(backend), daemon=True).start()
    state = with_timeout(lambda: loop.run(backend=backend))
    assert state.ret_value == ["r1", "r2"]  # was ["r1", "r1"]: the first gen's meta info


def test_text_iter_of_a_variable_a_later_gen_rewrites_streams_the_new_gen():
    backend = CountingBackend(hold_word="r1")

    @lmnb.function
    def twice(s):
        s += "Q: " + gen("x", max_tokens=4) + "\n"
        s["x"]
        s += "Q: " + gen("x", max_tokens=4) + "\n"
        return list(s.text_iter("x"))

    threading.Thread(target=lambda: release_once_held(backend), daemon=True).start()
    state = with_timeout(lambda: twice.run(backend=backend))
    assert state.ret_value == ["r2"]  # was ["r1"]: the first gen's value, as if final


def test_a_read_after_several_gens_writing_a_variable_waits_for_the_last():
    backend = CountingBackend(hold_word="R: ")  # the second gen is held, the first is not

    @lmnb.function
    def steps(s):
        s += "Q: " + gen("x", max_tokens=4) + "\n"
        s += "R: " + gen("x", max_tokens=4) + "\n"
        return s["x"]

    threading.Thread(target=lambda: release_once_held(backend), daemon=True).start()
    state = with_timeout(lambda: steps.run(backend=backend))
    assert state.ret_value == "r2"  # was "r1": the first gen's end marked "x" final


def test_a_gen_after_a_join_that_gathers_its_variable_is_waited_for():
    backend = CountingBackend(hold_word="after")

    @lmnb.function
    def gathered(s):
        forks = s.fork(2)
        forks += "F: " + gen("y", max_tokens=4)
        s.join(forks)
        s += "after: " + gen("y", max_tokens=4)
        return s["y"]

    threading.Thread(target=lambda: release_once_held(backend), daemon=True).start()
    state = with_timeout(lambda: gathered.run(backend=backend))
    assert state.ret_value == "r3"  # SGLang keeps a variable the parent has: the gen's value
