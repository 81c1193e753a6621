"""Programs as tasks on one event loop (`lmnb.lang.event_loop`): thousands at once without a thread
each, no thread left behind, Ctrl-C in the middle of `run_batch` on a real runtime, and the
asyncio forms (`arun`, `run_batch_iter`, `run_batch(as_completed=True)`).

Deterministic: the backends below hold programs on asyncio futures that only the test's own
events resolve; timeouts only bound a failing test."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import lmnb
from lmnb import gen, select
from lmnb.lang.backends.base import CancelEvent, Generation, ProgramAborted
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.backends.submit_chunks import SubmitChunks
from lmnb.lang.event_loop import program_loop
from lmnb.lang.ir import GenParams
from tests.fake_backend import TextOnlyFake
from tests.idle import wait_idle

GUARD_S = 60.0  # only reached when the behaviour under test is broken


class BarrierBackend(TextOnlyFake):
    """An `AsyncBackend` whose gens all wait until `count` of them are in flight at once: the
    programs can only finish if that many run concurrently. The text is the prompt's last
    word, reversed."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.in_flight = 0
        self.most = 0
        self._all_in: asyncio.Event | None = None

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        cancel: threading.Event | None = None, **extra: Any) -> Generation:
        if self._all_in is None:
            self._all_in = asyncio.Event()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.count:
            self._all_in.set()
        await asyncio.wait_for(self._all_in.wait(), GUARD_S)
        self.in_flight -= 1
        text = prompt.split()[-1][::-1]
        if on_delta is not None:
            on_delta(text)
        return Generation(text, {"finish_reason": {"type": "stop"}})

    async def aselect(self, prompt: str, choices: tuple[str, ...], method: str,
                      **extra: Any) -> tuple[str, dict]:
        return choices[-1], {}

    async def acache_prefix(self, prompt: str, **extra: Any) -> None:
        pass

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise AssertionError("the program loop awaits agenerate")

    def select(self, *args: Any, **kwargs: Any) -> tuple[str, dict]:
        raise AssertionError("the program loop awaits aselect")


@lmnb.function
def echo(s, word):
    s += "say " + word + gen("said", max_tokens=1)
    if s["said"] == word[::-1]:  # a read: the body is suspended, not a thread
        s += select("pick", choices=["yes", "no"])


def test_two_thousand_programs_run_at_once_on_one_loop():
    size = 2000
    backend = BarrierBackend(size)
    program_loop()
    threads = {thread.ident for thread in threading.enumerate()}
    states = echo.run_batch([{"word": f"w{i}"} for i in range(size)], backend=backend)
    assert backend.most == size  # every gen was in flight at the same time
    assert [s["said"] for s in states] == [f"w{i}"[::-1] for i in range(size)]
    assert all(s["pick"] == "no" for s in states)
    assert {thread.ident for thread in threading.enumerate()} <= threads  # no new thread


def test_programs_and_forks_take_no_thread():
    @lmnb.function
    def branches(s):
        s += "a b"
        forks = s.fork(3)
        forks += gen("x", max_tokens=1)
        forks.join()

    backend = BarrierBackend(3)
    program_loop()
    before = {t.ident for t in threading.enumerate()}
    state = branches.run(backend=backend)
    assert state["x"] == ["b", "b", "b"]
    assert {t.ident for t in threading.enumerate()} <= before


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[lmnb.Runtime]:
    runtime = lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=4096)
    yield runtime
    runtime.close()


def test_no_thread_is_left_after_a_thousand_runs(rt):
    @lmnb.function
    def one(s, i):
        s += "Number " + str(i) + ":" + gen("n", max_tokens=1, temperature=0)
        s += " is " + s["n"]

    fake, local = BarrierBackend(1), LocalBackend(rt)
    one.run(0, backend=local)  # the program loop exists
    threads = {thread.ident for thread in threading.enumerate()}
    for i in range(1000):  # the interpreter's machinery, on a backend that costs nothing
        assert one.run(i, backend=fake)["n"] == f"{i}:"[::-1]
    for i in range(50):  # and over the runtime's output streams
        assert isinstance(one.run(i, backend=local)["n"], str)
    states = one.run_batch([{"i": i} for i in range(100)], backend=local)
    assert all(isinstance(s["n"], str) for s in states)
    assert {thread.ident for thread in threading.enumerate()} <= threads  # no new thread


def test_run_batch_fills_the_first_prefill_pass_as_a_raw_generate_does(rt):
    """The programs of a `run_batch` reach the scheduler as the prompts of one `generate` of a
    list do: the first ones together, in one message (their gens are held for a turn of the
    program loop and sent in chunks, `SubmitChunks`), so the first pass is as full as the raw
    paths'. The prompts are long enough that the pass's token budget (2048 on the CPU) binds
    before the first chunk of 8 is used up: a count that does not depend on timing. A tiny GIL
    switch interval lets the scheduler thread run between any two submissions (as on a GPU):
    gens sent one by one would give a first pass of one request."""
    rng = random.Random(7)
    words = "time year people way day man thing woman life child world school state".split()
    prompts = [f"Text {i}: " + " ".join(rng.choice(words) for _ in range(300))
               for i in range(10)]
    assert all(280 <= len(rt.encode(p)) <= 400 for p in prompts)  # 6-7 of them fill a pass
    params = {"max_new_tokens": 2, "temperature": 0.0}

    @lmnb.function
    def continue_text(s, text):
        s += text + gen("a", max_tokens=2, temperature=0)

    def first_pass(work: Callable[[], Any]) -> tuple[int, int]:
        assert rt.flush_cache()
        passes: list[tuple[int, int]] = []
        rt.set_batch_hook(lambda batch: passes.append((batch.size, sum(batch.extend_lens)))
                          if batch.mode.name == "EXTEND" else None)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            work()
        finally:
            sys.setswitchinterval(interval)
            rt.set_batch_hook(None)
        return passes[0]

    wait_idle(rt, check_integrity=True)
    ids = [rt.encode(p) for p in prompts]
    raw_text = first_pass(lambda: rt.generate(prompts, params))
    raw_ids = first_pass(lambda: rt.generate(input_ids=ids, sampling_params=params))
    states: list[Any] = []
    dsl = first_pass(lambda: states.extend(continue_text.run_batch(
        [{"text": p} for p in prompts], backend=LocalBackend(rt))))
    assert all(isinstance(state["a"], str) for state in states)
    assert raw_text[0] > 1 and raw_text[1] == 2048  # the budget bound the pass
    assert dsl == raw_text == raw_ids


def test_submit_chunks_grow_within_a_turn_of_the_loop():
    """`SubmitChunks` sends a turn's submissions as `Runtime.generate` chunks a list of prompts:
    8, 16, 32, ... and the rest when the turn ends; the next turn starts at 8 again."""
    sent: list[int] = []
    held: list[int] = []

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        held.append(0)
        try:
            yield
        finally:
            sent.append(held.pop())

    chunks = SubmitChunks(hold)

    def submit(count: int) -> None:
        for _ in range(count):
            with chunks.submitting():
                held[-1] += 1

    async def turns() -> None:
        submit(100)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sent == [8, 16, 32, 44]
        submit(3)
        await asyncio.sleep(0)

    asyncio.run(turns())
    assert sent == [8, 16, 32, 44, 3]

    from lmnb.lang.backends.submit_chunks import whole_turns

    async def whole() -> None:
        with whole_turns():  # a batch starting together: the turn's in one hand-over
            submit(100)
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    sent.clear()
    asyncio.run(whole())
    assert sent == [100]

    async def overlapping() -> None:
        """A batch's block holds its own programs' gens only, also while an unrelated run
        submits in the same turn, and only while it is open."""
        go, later = asyncio.Event(), asyncio.Event()

        async def other_run() -> None:
            await go.wait()
            submit(8)

        async def program() -> None:
            await go.wait()
            submit(100)
            await later.wait()
            submit(20)

        other = asyncio.ensure_future(other_run())
        with whole_turns():
            started = asyncio.ensure_future(program())
            await asyncio.sleep(0)
            go.set()  # the other run's gens, then the program's, in one turn
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        later.set()
        await asyncio.gather(other, started)
        await asyncio.sleep(0)

    sent.clear()
    asyncio.run(overlapping())
    assert sent == [8, 100, 8, 12]


class _CountedHolds:
    """A runtime whose `batched_submits` blocks (hand-overs to the scheduler) are counted."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self.holds = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    @contextlib.contextmanager
    def batched_submits(self) -> Iterator[None]:
        with self._runtime.batched_submits():
            yield
        self.holds += 1


def test_run_batch_starts_its_programs_together_or_in_waves(rt, monkeypatch):
    """`global_config.batch_wave` None: a lead wave's first gens reach the scheduler in one
    hand-over, the rest's in another (lead None: all in one); n: in waves of n, 2n, ... (one
    hand-over each); the states are the same."""
    @lmnb.function
    def one(s, i):
        s += f"Number {i} is" + gen("a", max_tokens=2, temperature=0)

    texts = {}
    for wave, lead, hand_overs in ((None, None, 1), (None, 8, 2), (4, 8, 3)):  # 4, 8, last 8
        monkeypatch.setattr(lmnb.global_config, "batch_wave", wave)
        monkeypatch.setattr(lmnb.global_config, "batch_lead_wave", lead)
        counted = _CountedHolds(rt)
        states = one.run_batch([{"i": i} for i in range(20)], backend=LocalBackend(counted))
        texts[wave, lead] = [state["a"] for state in states]
        assert counted.holds == hand_overs
    assert texts[None, None] == texts[None, 8] == texts[4, 8]


def test_start_waves():
    from lmnb.lang.batch_waves import start_waves

    assert start_waves(32, lead=8, wave=None) == [
        [0, 4, 8, 12, 16, 20, 24, 28], [i for i in range(32) if i % 4]]
    assert start_waves(16, lead=8, wave=None) == [list(range(16))]  # small: together
    assert start_waves(32, lead=None, wave=None) == [list(range(32))]
    assert start_waves(20, lead=8, wave=4) == [[0, 1, 2, 3], list(range(4, 12)),
                                               list(range(12, 20))]


class _PausedHandOvers:
    """A runtime whose hand-overs to the scheduler are logged beside the program bodies (`log`),
    and whose first forward pass, once run, holds the scheduler until the second hand-over is
    sent: the second pass is then planned with everything the batch handed over, whatever the
    machine's speed."""

    def __init__(self, runtime: lmnb.Runtime, log: list[Any]) -> None:
        self._runtime = runtime
        self.log = log
        self._count = 0
        self._hand_overs = 0
        self._first_pass = threading.Event()
        self._second_sent = threading.Event()
        self.passes: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def submit_encoded(self, ids: list[int], params: Any, **options: Any) -> Any:
        self._count += 1
        return self._runtime.submit_encoded(ids, params, **options)

    @contextlib.contextmanager
    def batched_submits(self) -> Iterator[None]:
        with self._runtime.batched_submits():
            yield
        sent, self._count = self._count, 0
        self.log.append(("sent", sent))
        self._hand_overs += 1
        if self._hand_overs == 1:  # the lead wave's: its pass runs before the rest start
            assert self._first_pass.wait(GUARD_S)
        else:
            self._second_sent.set()

    def hook(self, batch: Any) -> None:
        self.passes.append((batch.mode.name, batch.size))
        if not self._first_pass.is_set():
            self._first_pass.set()
            assert self._second_sent.wait(GUARD_S)


def test_run_batch_lead_wave_starts_the_engine_before_the_rest_with_the_same_passes(rt):
    """The lead wave (every 4th of 32 programs, 4 few-shot prefixes of 8 questions each) reaches
    the scheduler before the other bodies run; its first pass admits one request per prefix, as
    a pass planned with the whole batch (`generate` of the prompts' ids) does, and the second
    pass takes every other request: the same extend passes as the raw ids."""
    prefixes = [f"Task {p}: " + " ".join(f"w{p}x{k}" for k in range(40)) + "\n"
                for p in range(4)]
    items = [{"prefix": prefix, "q": f"Q{q}: what is {q}?"}
             for prefix in prefixes for q in range(8)]
    log: list[Any] = []

    @lmnb.function
    def ask(s, prefix, q):
        log.append(("body", items.index({"prefix": prefix, "q": q})))
        s += prefix + q + gen("a", max_tokens=2, temperature=0)

    paused = _PausedHandOvers(rt, log)
    wait_idle(rt)
    assert rt.flush_cache()  # nothing cached by earlier tests
    rt.set_batch_hook(paused.hook)
    try:
        states = ask.run_batch(items, backend=LocalBackend(paused))
    finally:
        rt.set_batch_hook(None)
    assert all(state.error() is None for state in states)
    lead = [0, 4, 8, 12, 16, 20, 24, 28]
    assert log == [*(("body", i) for i in lead), ("sent", 8),
                   *(("body", i) for i in range(32) if i not in lead), ("sent", 24)]
    dsl_extends = [size for mode, size in paused.passes if mode == "EXTEND"]

    raw: list[tuple[str, int]] = []
    wait_idle(rt)
    assert rt.flush_cache()
    rt.set_batch_hook(lambda batch: raw.append((batch.mode.name, batch.size)))
    try:
        rt.generate(input_ids=[rt.encode(item["prefix"] + item["q"]) for item in items],
                    sampling_params={"max_new_tokens": 2, "temperature": 0})
    finally:
        rt.set_batch_hook(None)
    assert dsl_extends == [size for mode, size in raw if mode == "EXTEND"] == [4, 28]


def _watched(cancel: threading.Event | None, cancels: list[threading.Event]) -> asyncio.Future:
    """A future of the running loop, done when `cancel` (a gen's CancelEvent, kept in
    `cancels`) is set."""
    assert isinstance(cancel, CancelEvent)
    cancels.append(cancel)
    loop = asyncio.get_running_loop()
    cancelled = loop.create_future()
    cancel.on_set(lambda: loop.call_soon_threadsafe(
        lambda: cancelled.done() or cancelled.set_result(None)))
    return cancelled


class HoldingBackend(LocalBackend):
    """Sends each gen to the runtime; once `expected` of them stream text, interrupts the main
    thread. A gen never returns before its program is cancelled: `run_batch` cannot end before
    the interrupt lands."""

    def __init__(self, runtime: lmnb.Runtime, expected: int) -> None:
        super().__init__(runtime)
        self.expected = expected
        self.streaming = 0
        self.cancels: list[threading.Event] = []

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        cancel: threading.Event | None = None, **extra: Any) -> Generation:
        cancelled = _watched(cancel, self.cancels)
        first = True

        def delta(text: str) -> None:
            nonlocal first
            if first:
                first = False
                self.streaming += 1
                if self.streaming == self.expected:
                    _thread.interrupt_main()

        await super().agenerate(prompt, params, on_delta=delta, cancel=cancel, **extra)
        await asyncio.wait_for(cancelled, GUARD_S)
        raise ProgramAborted("cancelled")


@pytest.mark.parametrize("compiled", [False, True])
def test_ctrl_c_in_the_middle_of_run_batch_aborts_every_request(rt, compiled, default_sigint):
    @lmnb.function
    def long(s, i):
        s += "Story " + i + ":" + gen("story", max_tokens=400, ignore_eos=True)

    backend = HoldingBackend(rt, expected=4)
    program = long.compile() if compiled else long
    with pytest.raises(KeyboardInterrupt):
        program.run_batch([{"i": str(i)} for i in range(8)], backend=backend, num_threads=4)
    assert len(backend.cancels) == 4  # the 4 programs not started never start
    assert all(cancel.is_set() for cancel in backend.cancels)
    wait_idle(rt, check_integrity=True)
    assert rt.stats()["protected_tokens"] == 0
    assert rt.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_as_completed_yields_states_as_they_finish(rt):
    @lmnb.function
    def count(s, n):
        s += "Count:" + gen("x", max_tokens=n, ignore_eos=True, temperature=0)

    backend = LocalBackend(rt)
    order = [state["x"] for state in count.run_batch(
        [{"n": 24}, {"n": 1}], backend=backend, as_completed=True)]
    tokens = [len(rt.tokenizer.encode(text, add_special_tokens=False)) for text in order]
    assert tokens[0] < tokens[1]  # the one-token program came back first


def test_leaving_as_completed_early_aborts_the_rest(rt):
    @lmnb.function
    def count(s, n):
        s += "Count:" + gen("x", max_tokens=n, ignore_eos=True, temperature=0)

    backend = LocalBackend(rt)
    states = count.run_batch([{"n": 1}, {"n": 400}], backend=backend, as_completed=True)
    first = next(states)
    assert first.error() is None
    states.close()
    wait_idle(rt, check_integrity=True)
    assert rt.stats()["protected_tokens"] == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_generator_style_yields_every_state_in_the_batch_order(rt, compiled, capfd):
    """SGLang's `run_batch(generator_style=True)`: a generator of every program's state in the
    batch's order (the one-token programs finish first, yet come after the 24-token one); the
    progress bar counts every program."""
    @lmnb.function
    def count(s, n):
        s += "Count:" + gen("x", max_tokens=n, ignore_eos=True, temperature=0)

    program = count.compile() if compiled else count
    sizes = [24, 1, 8, 1]
    states = program.run_batch([{"n": n} for n in sizes], backend=LocalBackend(rt),
                               generator_style=True, progress_bar=True)
    assert isinstance(states, Iterator) and not isinstance(states, list)
    assert [state.get_meta_info("x")["completion_tokens"] for state in states] == sizes
    assert "4/4" in capfd.readouterr().err
    with pytest.raises(ValueError, match="generator_style"):
        program.run_batch([{"n": 1}], backend=LocalBackend(rt), generator_style=True,
                          as_completed=True)


class HeldBackend(LocalBackend):
    """Sends each gen to the runtime; a gen whose prompt holds "hold" sets `streaming` at its
    first text and never returns before its program is aborted (its `cancel` is kept)."""

    def __init__(self, runtime: lmnb.Runtime) -> None:
        super().__init__(runtime)
        self.streaming = threading.Event()
        self.cancels: list[threading.Event] = []

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        cancel: threading.Event | None = None, **extra: Any) -> Generation:
        if "hold" not in prompt:
            return await super().agenerate(prompt, params, on_delta=on_delta, cancel=cancel,
                                           **extra)
        cancelled = _watched(cancel, self.cancels)
        await super().agenerate(prompt, params, on_delta=lambda _: self.streaming.set(),
                                cancel=cancel, **extra)
        await asyncio.wait_for(cancelled, GUARD_S)
        raise ProgramAborted("cancelled")


def test_leaving_generator_style_early_aborts_the_rest(rt):
    @lmnb.function
    def story(s, topic):
        s += "Story about " + topic + ":" + gen("x", max_tokens=400 if topic == "hold" else 1,
                                                ignore_eos=True)

    backend = HeldBackend(rt)
    batch = [{"topic": t} for t in ("cats", "dogs", "hold", "owls")]
    states = story.run_batch(batch, backend=backend, generator_style=True)
    assert [next(states).text().split(":")[0] for _ in range(2)] == [
        "Story about cats", "Story about dogs"]
    assert backend.streaming.wait(GUARD_S)  # the held program's request is in the runtime
    states.close()  # the third cannot finish unless aborted: the consumer stops here
    assert len(backend.cancels) == 1 and backend.cancels[0].wait(GUARD_S)
    wait_idle(rt, check_integrity=True)
    assert rt.stats()["protected_tokens"] == 0
    assert rt.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_arun_and_run_batch_iter_leave_the_callers_loop_free(rt):
    @lmnb.function
    def answer(s, q):
        s += q + gen("a", max_tokens=2, temperature=0)
        s += " / " + s["a"]

    backend = LocalBackend(rt)
    expected = {q: answer.run(q, backend=backend).text() for q in ("Hi", "Yes", "No")}

    async def main() -> tuple[str, list[str], int]:
        ticks = 0

        async def tick() -> None:  # runs only while the loop is free
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        state = await answer.arun("Hi", backend=backend)
        texts = [s.text() async for s in answer.run_batch_iter(
            [{"q": "Yes"}, {"q": "No"}], backend=backend)]
        ticker.cancel()
        return state.text(), texts, ticks

    text, texts, ticks = asyncio.run(main())
    assert text == expected["Hi"]
    assert sorted(texts) == sorted([expected["Yes"], expected["No"]])
    assert ticks > 0


def test_one_wake_up_of_the_loop_per_burst_of_deliveries():
    """The output thread delivers to every stream of a step; the loop awaiting them all is
    woken once (one self-pipe write), not once per stream."""
    from lmnb.runtime.output.stream import OutputStream

    streams = [OutputStream([rid]) for rid in range(100)]
    calls = []

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), threadsafe(*a))[1]
        readers = [asyncio.ensure_future(stream.aresults()) for stream in streams]
        await asyncio.sleep(0)  # every reader awaits its stream now

        def deliver() -> None:
            for rid, stream in enumerate(streams):
                stream.deliver([{"text": f"t{rid}", "output_ids": [rid], "meta_info": {
                    "id": str(rid), "finish_reason": {"type": "stop"}}}])

        producer = threading.Thread(target=deliver)
        producer.start()
        producer.join()  # the loop is held meanwhile: the burst ends before it runs again
        return [result[0]["text"] for result in await asyncio.gather(*readers)]

    assert asyncio.run(main()) == [f"t{rid}" for rid in range(100)]
    assert len(calls) == 1


def test_selects_are_scored_on_the_loop_without_threads(rt):
    @lmnb.function
    def pick(s, q):
        s += q + " The answer is" + select("a", choices=[" yes", " no", " maybe"])

    backend = LocalBackend(rt)
    pick.run("Warm up.", backend=backend)
    threads = {thread.ident for thread in threading.enumerate()}
    questions = [f"Question {i}: is {i} even?" for i in range(12)]
    states = pick.run_batch([{"q": q} for q in questions], backend=backend)
    assert {thread.ident for thread in threading.enumerate()} <= threads  # no new thread
    for q, state in zip(questions, states, strict=True):  # as the blocking scorer scores them
        _, meta = backend.select(q + " The answer is", (" yes", " no", " maybe"),
                                 "token_length_normalized")
        assert state.get_meta_info("a")["normalized_prompt_logprobs"] == pytest.approx(
            meta["normalized_prompt_logprobs"], abs=1e-4)


class _KeywordRecorder:
    """A runtime whose `generate` calls' keywords are recorded (the rest is the runtime's)."""

    def __init__(self, runtime: lmnb.Runtime) -> None:
        self._runtime = runtime
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self._runtime.generate(*args, **kwargs)

    def submit_encoded(self, ids: list[int], params: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self._runtime.submit_encoded(ids, params, **kwargs)


def test_only_watched_gens_stream_their_tokens(rt):
    """A gen that nobody reads as it comes (a `run_batch` program, a run without `stream`)
    takes one whole chunk per request (no wake-up of the loop per token); a streamed run's
    gens stream. Both give the same text."""
    prompts = ["The river", "A small bird sang"]
    params = {"max_new_tokens": 6, "temperature": 0.0, "n": 2}
    blocking = rt.generate(prompts, params)
    with rt.generate(prompts, params, stream=True, incremental=False) as whole:
        chunks = list(whole)
    assert len(chunks) == 4 and sorted(c["index"] for c in chunks) == [0, 1, 2, 3]
    assert [c["text"] for c in sorted(chunks, key=lambda c: c["index"])] == [
        r["text"] for r in blocking]

    @lmnb.function
    def answer(s, text):
        s += text + gen("a", max_tokens=6, temperature=0)

    recorder = _KeywordRecorder(rt)
    backend = LocalBackend(recorder)  # type: ignore[arg-type]
    states = answer.run_batch([{"text": p} for p in prompts], backend=backend)
    streamed = answer.run(text=prompts[0], backend=backend, stream=True)
    pieces = list(streamed.text_iter("a"))
    assert [call.get("incremental", True) for call in recorder.calls] == [False, False, True]
    assert len(pieces) > 1 and "".join(pieces) == streamed["a"] == states[0]["a"]
    assert [state["a"] for state in states] == [r["text"] for r in blocking[::2]]


def test_run_batch_shares_the_gil_while_its_programs_start():
    """While a batch starts its programs the GIL switch interval is
    `global_config.batch_switch_interval` (the scheduler thread gets the GIL back soon after
    each torch call); Python's is restored afterwards, and a shorter one is kept."""
    seen: list[float] = []

    class Recording(BarrierBackend):
        def __init__(self) -> None:
            super().__init__(1)

        async def agenerate(self, prompt: str, params: GenParams, **extra: Any) -> Generation:
            seen.append(sys.getswitchinterval())
            return await super().agenerate(prompt, params, **extra)

    @lmnb.function
    def one(s, i):
        s += f"Q{i}: " + gen("a")

    before = sys.getswitchinterval()
    assert lmnb.global_config.batch_switch_interval < before
    one.run_batch([{"i": i} for i in range(30)], backend=Recording())
    assert len(seen) == 30
    assert seen == [pytest.approx(lmnb.global_config.batch_switch_interval)] * 30
    assert sys.getswitchinterval() == before
    sys.setswitchinterval(1e-5)
    try:
        one.run_batch([{"i": i} for i in range(3)], backend=Recording())
        assert sys.getswitchinterval() == pytest.approx(1e-5)
        assert seen[-1] == pytest.approx(1e-5)
    finally:
        sys.setswitchinterval(before)


def test_sharing_the_gil_nests_and_leaves_a_value_set_meanwhile():
    from lmnb.lang.gil_share import sharing_the_gil

    before = sys.getswitchinterval()
    with sharing_the_gil(2e-4):
        with sharing_the_gil(1e-4):
            assert sys.getswitchinterval() == pytest.approx(2e-4)  # the first one's
        assert sys.getswitchinterval() == pytest.approx(2e-4)
    assert sys.getswitchinterval() == before
    with sharing_the_gil(None):
        assert sys.getswitchinterval() == before
    try:
        with sharing_the_gil(2e-4):
            sys.setswitchinterval(3e-3)  # someone else's
        assert sys.getswitchinterval() == pytest.approx(3e-3)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its death
def test_sharing_the_gil_is_restored_when_its_thread_dies_inside_a_block():
    """The program loop's thread dies while a batch starts its programs: the interval comes
    back at once, and later blocks (on the new loop) shorten and restore it as usual."""
    from lmnb.lang.event_loop import _ProgramLoop
    from lmnb.lang.gil_share import sharing_the_gil

    before = sys.getswitchinterval()
    programs = _ProgramLoop()  # not the shared one: this one is killed

    def die() -> None:
        raise SystemExit

    async def starting() -> None:
        with sharing_the_gil(1e-4):
            asyncio.get_running_loop().call_soon(die)
            await asyncio.sleep(0)  # never resumed: `die` stops the loop's thread first
            raise AssertionError("resumed")

    try:
        asyncio.run_coroutine_threadsafe(starting(), programs.loop)
        programs.thread.join(timeout=60)
        assert not programs.thread.is_alive()
        assert sys.getswitchinterval() == before
        with sharing_the_gil(2e-4):
            assert sys.getswitchinterval() == pytest.approx(2e-4)
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
        programs.loop.close()

    stuck = sharing_the_gil(1e-4)  # a thread left its block open without `thread_ended`
    opener = threading.Thread(target=stuck.__enter__)
    opener.start()
    opener.join()
    try:
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        with sharing_the_gil(2e-4):
            assert sys.getswitchinterval() == pytest.approx(2e-4)
        assert sys.getswitchinterval() == before
        stuck.__exit__(None, None, None)  # its late exit touches nothing
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


def test_local_backend_submits_encoded_ids_with_parsed_params(rt):
    """A text prompt goes in as the runtime's own ids with parsed `SamplingParams`
    (`Runtime.submit_encoded`): the same output as `generate(input_ids=...)`, the context length
    still enforced (max_new_tokens that do not fit are refused), and bad input a clear error."""
    from lmnb.params import InvalidRequestError, SamplingParams

    backend = LocalBackend(rt)
    assert backend.encoded_submitter is rt
    prompt = "The quick brown fox"
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    with rt.submit_encoded(rt.encode(prompt), params, incremental=False) as stream:
        (whole,) = list(stream)
    raw = rt.generate(input_ids=rt.encode(prompt), sampling_params=params.to_dict())
    assert whole["output_ids"] == raw["output_ids"] and whole["text"] == raw["text"]

    @lmnb.function
    def one(s):
        s += prompt + gen("a", max_tokens=5, temperature=0)

    assert one.run(backend=backend)["a"] == raw["text"]
    assert params.max_new_tokens == 5  # shared parameters are never mutated

    with pytest.raises(InvalidRequestError, match="context length"):
        rt.submit_encoded([1] * rt.context_len, params)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        rt.submit_encoded([], params)
    near = rt.context_len - 3
    with pytest.raises(InvalidRequestError, match=r"you requested \d+ tokens \(\d+ in the "
                       r"messages, 50 in the completion\).*at most 3 fit"):
        rt.submit_encoded([5] * near, SamplingParams(max_new_tokens=50))
    with rt.submit_encoded([5] * near, SamplingParams(max_new_tokens=3, ignore_eos=True),
                           incremental=False) as stream:
        (fits,) = list(stream)
    assert len(fits["output_ids"]) == 3
    error = one.run(backend=backend, top_k=-3).error()
    assert isinstance(error, InvalidRequestError) and "top_k" in str(error)
    assert rt.generate("ok", {"max_new_tokens": 1})["text"] is not None  # still usable


def test_call_soon_from_threads_keeps_order_and_context():
    """`event_loop.call_soon` from another thread: a burst of callbacks runs on the program
    loop in the order of the calls, each in its caller's context."""
    import contextvars

    from lmnb.lang.event_loop import call_soon

    tag: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="loop")
    seen: list[tuple[int, str, bool]] = []
    done = threading.Event()

    def note(i: int) -> None:
        seen.append((i, tag.get(), threading.get_ident() == loop_ident))
        if i == 99:
            done.set()

    loop_ident = program_loop_ident()

    def caller() -> None:
        for i in range(100):
            tag.set(f"caller {i}")
            call_soon(note, i)

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    assert done.wait(30)
    assert seen == [(i, f"caller {i}", True) for i in range(100)]


def program_loop_ident() -> int:
    from lmnb.lang.event_loop import program_loop

    idents: list[int] = []
    ready = threading.Event()
    program_loop().call_soon_threadsafe(lambda: (idents.append(threading.get_ident()),
                                                 ready.set()))
    assert ready.wait(30)
    return idents[0]


def test_gen_texts_complete_at_each_samples_last_update():
    from lmnb.lang.backends.runtime_gen import GenTexts
    from lmnb.lang.ir import GenParams

    gen = GenTexts(GenParams(n=2), None)
    assert not gen.update(0, "a", {"finish_reason": None}) and not gen.complete
    assert not gen.update(0, "ab", {"finish_reason": {"type": "length"}}) and not gen.complete
    assert not gen.update(1, "c", {"finish_reason": {"type": "stop"}})
    assert gen.complete
    cut = GenTexts(GenParams(n=2, stop_regex=("b",)), None)
    cut.update(0, "ab", {"finish_reason": None})  # cut here, the runtime's last chunk to come
    cut.update(1, "x", {"finish_reason": {"type": "length"}})
    assert not cut.complete and cut.texts == ["a", "x"]
