"""The DSL end to end on a tiny random-weight Llama (SmolLM2's tokenizer and chat template): state
text and variables, gen arguments against `Runtime.generate`, roles against the chat template,
errors, fork/join with the shared-prefix hint, streaming, run_batch, and the interpreter's threads.
A fake backend (the Backend protocol without a model) checks what a model can't show."""

from __future__ import annotations

import _thread
import gc
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import lmnb
from lmnb import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    system,
    user,
    user_begin,
    user_end,
)
from lmnb.lang import default_backend as default_backend_module
from lmnb.lang.api import DTYPE_REGEXES
from lmnb.lang.backends.base import Backend, Generation, ProgramAborted
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.event_loop import program_loop
from lmnb.lang.interpreter import ProgramError
from lmnb.lang.ir import GenParams
from lmnb.params import SamplingParams
from lmnb.runtime.core import InvalidRequestError
from tests.fake_backend import TextOnlyFake
from tests.idle import wait_idle

PROMPT = "def fibonacci(n):"  # the tiny model's greedy output has several distinct tokens
CONTEXT = "Shared context: " + " ".join(f"item{k}" for k in range(60)) + "\n"
GUARD_S = 60.0  # bounds a failing (hung) test only; no assertion depends on speed


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[lmnb.Runtime]:
    runtime = lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=8192)
    yield runtime
    runtime.close()


@pytest.fixture
def no_default_backend(monkeypatch) -> None:
    monkeypatch.setattr(default_backend_module, "_default_backend", None)  # restored afterwards


def greedy(rt: lmnb.Runtime, prompt: str, max_new_tokens: int, **params: Any) -> dict:
    return rt.generate(prompt, {"max_new_tokens": max_new_tokens, "temperature": 0, **params})


def assert_usable(rt: lmnb.Runtime) -> None:
    assert greedy(rt, PROMPT, 3)["meta_info"]["completion_tokens"] == 3
    rt.check_integrity()


def call_with_timeout(fn: Callable[[], Any], timeout: float = GUARD_S) -> Any:
    """Runs `fn` on a thread: a reader that hangs fails the test instead of blocking it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=timeout)


@dataclass
class Call:
    prompt: str
    params: GenParams
    start: float
    end: float = 0.0


class FakeBackend(TextOnlyFake):
    """Replies `reply` in 3 streamed pieces over `delay` seconds; records every call. With a
    `gate`, each call streams its first piece, sets `first_piece`, then waits for the gate."""

    def __init__(self, reply: str = "abcdef", delay: float = 0.0, tokenizer: Any = None,
                 error: BaseException | None = None, gate: threading.Event | None = None) -> None:
        super().__init__(ChatTemplate(tokenizer))
        self.reply, self.delay, self.error, self.gate = reply, delay, error, gate
        self.first_piece = threading.Event()
        self.calls: list[Call] = []
        self.events: list[tuple[str, str]] = []  # ("generate" | "cache_prefix", prompt)

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        call = Call(prompt, params, time.monotonic())
        self.calls.append(call)
        self.events.append(("generate", prompt))
        if self.error is not None:
            raise self.error
        third = max(1, len(self.reply) // 3)
        pieces = [self.reply[:third], self.reply[third:2 * third], self.reply[2 * third:]]
        for k, piece in enumerate(pieces):
            if cancel is not None and cancel.wait(self.delay / 3):
                raise ProgramAborted("the program was interrupted")
            if k == 1 and self.gate is not None:
                self.first_piece.set()
                assert self.gate.wait(GUARD_S), "the test never opened the gate"
            if on_delta is not None and piece:
                on_delta(piece)
        call.end = time.monotonic()
        n = params.n or 1
        meta = {"completion_tokens": len(self.reply)}
        if n > 1:
            return Generation([self.reply] * n, [meta] * n)
        return Generation(self.reply, meta)

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        return choices[0], {"method": method}

    def cache_prefix(self, prompt: str) -> None:
        self.events.append(("cache_prefix", prompt))


def test_fake_backend_implements_the_protocol():
    assert isinstance(FakeBackend(), Backend)


# ---- state: text, variables, meta info ----------------------------------------------------------
def test_text_variables_and_meta_info(rt):
    @lmnb.function
    def grade(s, question):
        s += "Question: " + question + "\n"
        s += "Grade: " + gen("grade", max_tokens=4)
        s.set_var("topic", "math")
        with s.var_scope("tail"):
            s += "\nEnd" + "."

    state = grade.run(question=PROMPT, backend=rt, temperature=0)
    prompt = f"Question: {PROMPT}\nGrade: "
    expected = greedy(rt, prompt, 4)
    assert state["grade"] == expected["text"]
    assert state.text() == prompt + expected["text"] + "\nEnd."
    assert state["topic"] == "math" and state["tail"] == "\nEnd."
    assert state.variables() == {"grade": expected["text"], "topic": "math", "tail": "\nEnd."}
    assert state.spans() == [("grade", len(prompt), len(prompt) + len(expected["text"]))]
    assert "grade" in state and "nope" not in state
    meta = state.get_meta_info("grade")
    assert meta["prompt_tokens"] == len(rt.encode(prompt)) == expected["meta_info"]["prompt_tokens"]
    assert meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert state.messages() == []


def test_run_defaults_are_inherited_and_gen_arguments_override(rt):
    @lmnb.function
    def two(s):
        s += PROMPT + gen("default")
        s += "\n" + gen("short", max_tokens=3)

    state = two.run(backend=rt, max_new_tokens=5, ignore_eos=True)
    assert state.get_meta_info("default")["completion_tokens"] == 5
    assert state.get_meta_info("short")["completion_tokens"] == 3

    first = two.run(backend=rt, max_new_tokens=5, temperature=0)
    again = two.run(backend=rt, max_new_tokens=5, temperature=0)
    assert first.text() == again.text()
    assert first["default"] == greedy(rt, PROMPT, 5)["text"]
    # the state's text is exactly the prompt text plus what was generated
    assert first.text() == PROMPT + first["default"] + "\n" + first["short"]
    assert first["short"] == greedy(rt, PROMPT + first["default"] + "\n", 3)["text"]


def test_gen_arguments_reach_the_backend():
    backend = FakeBackend()

    @lmnb.function
    def args(s):
        s += "x" + gen("a", max_tokens=7, min_tokens=2, stop=["END", "\n"], stop_token_ids=5,
                       ignore_eos=True, top_p=0.5, return_logprob=True, top_logprobs_num=3)
        s += gen("b")

    state = args.run(backend=backend, temperature=0.25, top_k=4, max_new_tokens=11)
    state.text()
    a, b = (call.params for call in backend.calls)
    assert (a.max_new_tokens, a.min_new_tokens, a.stop, a.stop_token_ids) == (7, 2, ("END", "\n"),
                                                                               (5,))
    assert (a.ignore_eos, a.top_p, a.return_logprob, a.top_logprobs_num) == (True, 0.5, True, 3)
    assert (a.temperature, a.top_k) == (0.25, 4)  # unset: the run's
    assert (b.max_new_tokens, b.temperature, b.top_k, b.ignore_eos) == (11, 0.25, 4, False)
    assert b.stop is None and b.return_logprob is None
    assert backend.calls[1].prompt == "x" + backend.reply


def test_local_backend_maps_params_to_sampling_params(rt):
    sampling = LocalBackend(rt).sampling_params(GenParams(
        max_new_tokens=6, min_new_tokens=3, ignore_eos=True, stop=("a",), stop_token_ids=(7,),
        temperature=0.0, n=2, regex="[0-9]+"))
    assert sampling == SamplingParams(
        max_new_tokens=6, min_new_tokens=3, ignore_eos=True, stop=["a"], stop_token_ids=[7],
        temperature=0.0, n=2, regex="[0-9]+").to_dict()


def test_stop_string(rt):
    full = greedy(rt, PROMPT, 12)["text"]
    p = next(p for p in range(2, len(full) - 3) if full.find(full[p:p + 3]) == p)
    stop = full[p:p + 3]

    @lmnb.function
    def stopped(s):
        s += PROMPT + gen("a", max_tokens=12, stop=stop) + "|"

    state = stopped.run(backend=rt, temperature=0)
    assert state["a"] == full[:p]
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": stop}
    assert state.text() == PROMPT + full[:p] + "|"


def test_stop_token_ids_and_min_tokens(rt):
    ids = greedy(rt, PROMPT, 12)["output_ids"]
    i = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])

    @lmnb.function
    def stopped(s, stop_id: int, min_tokens: int | None = None):
        s += PROMPT + gen("a", max_tokens=6, stop_token_ids=stop_id, min_tokens=min_tokens)

    state = stopped.run(ids[i], backend=rt, temperature=0)
    meta = state.get_meta_info("a")
    assert meta["finish_reason"] == {"type": "stop", "matched": ids[i]}
    assert meta["completion_tokens"] == i + 1
    assert state["a"] == rt.tokenizer.decode(ids[:i])
    # the first greedy token stops at once, unless min_tokens holds it back (EOS likewise)
    first = stopped.run(ids[0], backend=rt, temperature=0)
    assert first.get_meta_info("a")["completion_tokens"] == 1
    held = stopped.run(ids[0], min_tokens=3, backend=rt, temperature=0, ignore_eos=True)
    assert held.get_meta_info("a")["completion_tokens"] >= 3


def test_n_and_logprobs(rt):
    @lmnb.function
    def sample(s):
        s += PROMPT + gen("c", n=2, max_tokens=4, temperature=1.0, ignore_eos=True)
        s += "\n" + gen("lp", max_tokens=3, return_logprob=True, top_logprobs_num=2)

    state = sample.run(backend=rt, temperature=0)
    choices = state["c"]
    assert isinstance(choices, list) and len(choices) == 2
    assert all(isinstance(c, str) for c in choices)
    metas = state.get_meta_info("c")
    assert [m["completion_tokens"] for m in metas] == [4, 4]
    assert state.text().startswith(PROMPT + choices[0] + "\n")  # the first choice continues
    meta = state.get_meta_info("lp")
    assert len(meta["output_token_logprobs"]) == 3
    assert len(meta["output_top_logprobs"]) == 3
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert "output_token_logprobs" not in metas[0]


@pytest.mark.parametrize("as_list", [False, True], ids=["one", "list"])
def test_stop_regex_trims_before_the_first_match(rt, as_list):
    full = greedy(rt, PROMPT, 12)["text"]
    p = next(p for p in range(2, len(full) - 2) if full.find(full[p:p + 2]) == p)
    pattern = re.escape(full[p:p + 2])
    stop_regex = ["\N{SNOWMAN}+", pattern] if as_list else pattern

    @lmnb.function
    def stopped(s):
        s += PROMPT + gen("a", max_tokens=12, stop_regex=stop_regex)

    state = stopped.run(backend=rt, temperature=0)
    assert state["a"] == full[:p]
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop",
                                                          "matched": full[p:p + 2]}
    assert state.text() == PROMPT + full[:p]
    wait_idle(rt, check_integrity=True)  # the rest of the request was aborted


def test_gen_int_and_gen_string_send_regexes(rt):
    @lmnb.function
    def typed(s):
        s += "Age: " + gen_int("age") + "\nName: " + gen_string("name", max_tokens=9)

    backend = FakeBackend()
    typed.run(backend=backend).text()
    assert [c.params.regex for c in backend.calls] == [DTYPE_REGEXES[int], DTYPE_REGEXES[str]]
    assert backend.calls[1].params.max_new_tokens == 9

    # The runtime honours the regexes: the typed values parse.
    state = typed.run(backend=rt, temperature=1.0, max_new_tokens=12)
    assert state.error() is None
    assert re.fullmatch(DTYPE_REGEXES[int], state["age"]) or \
        state.get_meta_info("age")["finish_reason"]["type"] == "length"
    name = state.get_meta_info("name")
    if name["finish_reason"]["type"] == "stop":
        assert re.fullmatch(DTYPE_REGEXES[str], state["name"])

    # A regex the runtime cannot compile is a stored error, raised where it is read.
    @lmnb.function
    def broken(s):
        s += "x" + gen("bad", regex="(a", max_tokens=3)

    state = broken.run(backend=rt)
    assert isinstance(state.error(), InvalidRequestError)
    with pytest.raises(ProgramError) as info:
        state["bad"]
    assert isinstance(info.value.__cause__, InvalidRequestError)
    assert_usable(rt)


# ---- roles ------------------------------------------------------------------------------------
def test_roles_render_like_the_chat_template(rt):
    @lmnb.function
    def chat(s):
        s += system("You are terse.") + user("Q: " + "2+2?") + assistant("4")
        s += user("And 3+3?")
        s += assistant_begin()
        s.set_var("prompt", s.text())
        s += gen("a", max_tokens=5) + assistant_end()

    state = chat.run(backend=rt, temperature=0)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Q: 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"}]
    template = rt.tokenizer.apply_chat_template
    assert state["prompt"] == template(messages, tokenize=False, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": state["a"]})
    assert state.executor.messages_ == messages  # exact; messages() strips as SGLang
    assert state.messages() == [{**m, "content": m["content"].lstrip()} for m in messages]
    assert state.text() == template(messages, tokenize=False)
    assert state["a"] == greedy(rt, state["prompt"], 5)["text"]


def test_role_forms_give_the_same_text(rt):
    @lmnb.function
    def plus(s):
        s += user("Hi " + "there") + assistant("Hello")

    @lmnb.function
    def scoped(s):
        with s.user():
            s += "Hi "
            s += "there"
        with s.assistant():
            s += "Hello"

    @lmnb.function
    def method(s):
        s.user("Hi there")
        s.assistant("Hello")

    @lmnb.function
    def begin_end(s):
        s += user_begin() + "Hi there" + user_end() + assistant_begin() + "Hello" + assistant_end()

    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    expected = rt.tokenizer.apply_chat_template(messages, tokenize=False)  # + default system
    for program in (plus, scoped, method, begin_end):
        state = program.run(backend=rt)
        assert state.text() == expected, program.__name__
        assert state.messages() == messages


def test_role_methods_return_what_they_appended_and_bad_appends_are_value_errors():
    """As SGLang's `ProgramState`: `s.user(expr)` returns the role expression it appended, and
    `s += None` (or `forks += None`) raises ValueError in the program's body, and so does
    a number (`s += 5`; a TypeError too)."""
    returned = []

    @lmnb.function
    def method(s):
        returned.append(s.system("Be brief."))
        returned.append(s.user("Hi"))

    method.run(backend=FakeBackend()).sync()
    assert returned == [system("Be brief."), user("Hi")]

    @lmnb.function
    def appends_none(s, forked):
        if forked:
            forks = s.fork(2)
            forks += None
        s += None

    for forked in (False, True):
        with pytest.raises(ValueError, match="append None"):
            appends_none.run(forked=forked, backend=FakeBackend())
        with pytest.raises(ValueError, match="append None"):
            appends_none.trace(forked=forked)

    @lmnb.function
    def appends_a_number(s, forked):
        if forked:
            forks = s.fork(2)
            forks += 5
        s += 5

    for forked in (False, True):  # SGLang: ValueError; a TypeError too
        for error in (ValueError, TypeError):
            with pytest.raises(error, match="cannot add int"):
                appends_a_number.run(forked=forked, backend=FakeBackend())
            with pytest.raises(error, match="cannot add int"):
                appends_a_number.trace(forked=forked)


def test_role_errors_are_kept():
    @lmnb.function
    def bad(s):
        s += user_begin() + "x" + assistant_end()

    with pytest.raises(ProgramError, match="open role"):
        bad.run(backend=FakeBackend()).text()


def test_assistant_gen_stops_at_the_end_of_turn(rt):
    im_end = rt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    backend = FakeBackend(tokenizer=rt.tokenizer)
    assert backend.chat_template.end_of_turn() == ([], [im_end])
    assert LocalBackend(rt).chat_template.end_of_turn() == ([], [im_end])

    @lmnb.function
    def turns(s):
        s += "Plain: " + gen("plain")
        s += user("Hi") + assistant(gen("reply"))
        s += user("More") + assistant(gen("judged", stop="END", stop_token_ids=[9]))

    turns.run(backend=backend).text()
    plain, reply, judged = (call.params for call in backend.calls)
    assert plain.stop_token_ids is None and plain.stop is None
    assert reply.stop_token_ids == (im_end,)
    assert judged.stop == ("END",) and judged.stop_token_ids == (9, im_end)  # added, not replaced


# ---- errors -----------------------------------------------------------------------------------
def test_an_exception_in_the_program_is_raised_where_read():
    @lmnb.function
    def failing(s):
        s += "a" + gen("x")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):  # from run(), as in SGLang
        failing.run(backend=FakeBackend(delay=0.05))
    # A streamed run returns its state first: the error is raised where the state is read.
    state = failing.run(backend=FakeBackend(delay=0.05), stream=True)
    with pytest.raises(ProgramError, match="boom") as info:
        call_with_timeout(lambda: state["x"])
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ProgramError, match="boom"):
        state.text()
    assert isinstance(state.error(), ValueError)


def test_an_error_in_the_stream_is_raised_where_read(rt):
    @lmnb.function
    def invalid(s):
        s += PROMPT + gen("x", max_tokens=3) + gen("y", temperature=-1.0) + gen("z")

    state = invalid.run(backend=rt)
    assert state.spans()[0][0] == "x"  # what ran before the error ran; every reader raises it
    for read in (lambda: state["x"], lambda: state["y"], lambda: state["z"], state.text,
                 state.messages):
        with pytest.raises(ProgramError) as info:
            call_with_timeout(read)
        assert isinstance(info.value.__cause__, InvalidRequestError)
    assert_usable(rt)


class AbortedBackend(FakeBackend):
    """Replies as the runtime does to a request it aborted: the text so far, finish reason
    `{"type": "abort", ...}`; with `by_program`, the program had cancelled the call itself."""

    def __init__(self, *, by_program: bool = False) -> None:
        super().__init__()
        self.by_program = by_program

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        self.events.append(("generate", prompt))
        if self.by_program and cancel is not None:
            cancel.set()
        return Generation("ab", {"finish_reason": {"type": "abort", "message": "out of KV"}})


def test_a_gen_the_runtime_aborted_fails_the_program():
    @lmnb.function
    def two(s):
        s += "a" + gen("x", max_tokens=8)
        s += "b" + gen("y")

    backend = AbortedBackend()
    state = two.run(backend=backend)
    with pytest.raises(ProgramError, match="aborted the request: out of KV") as info:
        state.text()
    assert info.value.__cause__.lmnb_where[1] > 0  # the gen's line
    assert len(backend.events) == 1  # nothing after the aborted gen ran
    # The program's own abort (an interrupt, a failed sibling) stays an interruption.
    state = two.run(backend=AbortedBackend(by_program=True))
    assert isinstance(state.error(), ProgramAborted)


def test_missing_variable_raises_key_error_once_done():
    @lmnb.function
    def one(s):
        s += "a" + gen("x")

    state = one.run(backend=FakeBackend())
    with pytest.raises(KeyError, match="missing"):
        call_with_timeout(lambda: state["missing"])
    backend = FakeBackend(delay=0.3)
    start = time.monotonic()
    state = one.run(backend=backend, stream=True)
    with pytest.raises(KeyError):
        call_with_timeout(lambda: state["missing"])
    assert time.monotonic() - start >= 0.25  # it waited for the program to finish


# ---- fork and join ------------------------------------------------------------------------------
@lmnb.function
def branches(s, width: int):
    s += CONTEXT
    forks = s.fork(width)
    forks += "Common."  # one expression: every branch
    forks += [f"<{i}>" for i in range(width)]  # a list: one each
    try:
        forks += ["too", "few"][:width - 1]
    except ValueError as error:
        s.set_var("length_error", str(error))
    forks += lambda i: f" #{i}:" + gen("g", max_tokens=4)  # a callable of the branch index
    s.join(forks, mode="gather_variable")
    s += "\nDone"
    return forks


def test_fork_group_and_gather(rt):
    wait_idle(rt, check_integrity=True)
    assert rt.flush_cache()
    stats = rt.stats()
    state = branches.run(width=3, backend=rt, temperature=0)
    forks = state.ret_value
    assert len(forks) == 3 and list(forks) == [forks[0], forks[1], forks[2]]
    assert "3 branches" in state["length_error"]
    assert state["g"] == [f["g"] for f in forks]
    for i, f in enumerate(forks):
        assert f.text() == CONTEXT + f"Common.<{i}> #{i}:" + f["g"]
        assert f["g"] == greedy(rt, CONTEXT + f"Common.<{i}> #{i}:", 4)["text"]
    assert state.text() == CONTEXT + "\nDone"
    # the shared prefix was cached before the branches ran: every branch's gen hits all of it
    prefix_tokens = len(rt.encode(CONTEXT))
    cached = [f.get_meta_info("g")["cached_tokens"] for f in forks]
    assert all(c >= prefix_tokens - 1 for c in cached), (cached, prefix_tokens)
    after = rt.stats()
    assert after["cached_tokens"] - stats["cached_tokens"] >= 3 * (prefix_tokens - 1)


def test_fork_commits_the_prefix_once_before_the_branches():
    backend = FakeBackend()
    state = branches.run(width=3, backend=backend)
    state.text()
    assert backend.events[0] == ("cache_prefix", CONTEXT)
    assert [kind for kind, _ in backend.events] == ["cache_prefix"] + ["generate"] * 3
    assert state["g"] == [backend.reply] * 3

    backend = FakeBackend()
    branches.run(width=1, backend=backend).text()  # one branch: nothing shared, no hint
    assert [kind for kind, _ in backend.events] == ["generate"]


def test_concat_and_append_join_and_copy():
    backend = FakeBackend(reply="xy")

    @lmnb.function
    def concat(s):
        s += "P:"
        forks = s.fork(3)
        forks += lambda i: f"[{i}]" + gen("w")
        forks.join(mode="concat_and_append")
        s += "|"
        copy = s.copy()
        copy += "C"
        s += "S"
        return copy

    state = concat.run(backend=backend)
    assert state.text() == "P:[0]xy[1]xy[2]xy|S"
    assert state.ret_value.text() == "P:[0]xy[1]xy[2]xy|C"
    assert "w" not in state.variables()

    @lmnb.function
    def gather(s):
        forks = s.fork(2)
        forks += gen("w")
        forks.join()

    assert gather.run(backend=backend)["w"] == ["xy", "xy"]
    with pytest.raises(ValueError, match="join mode"):
        state.join([], mode="zip")


def test_gather_skips_branches_that_never_set_the_variable():
    """As SGLang's `gather_variable`: a variable's list holds the values of the branches that
    set it, in branch order; a branch without it adds nothing (no None in its place)."""
    backend = FakeBackend(reply="xy")

    @lmnb.function
    def uneven(s):
        forks = s.fork(3)
        forks += lambda i: "skip" if i == 1 else gen("w")
        forks[1] += gen("only_1")
        forks.join()

    for program in (uneven, uneven.compile()):
        state = program.run(backend=backend)
        assert state["w"] == ["xy", "xy"]
        assert state["only_1"] == ["xy"]


# ---- streaming ----------------------------------------------------------------------------------
def test_stream_returns_at_once_and_text_iter_streams(rt):
    @lmnb.function
    def story(s):
        s += PROMPT + gen("a", max_tokens=120, ignore_eos=True) + "\nEnd."

    gate = threading.Event()
    gated = FakeBackend(reply="123456", gate=gate)
    state = call_with_timeout(lambda: story.run(backend=gated, stream=True))
    assert gated.first_piece.wait(GUARD_S)  # run() returned while the gen was still streaming
    assert not state.idle
    gate.set()
    assert "".join(call_with_timeout(lambda: list(state.text_iter("a")))) == "123456"

    state = story.run(backend=rt, stream=True, temperature=0)
    pieces = list(state.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == state["a"]
    assert state.get_meta_info("a")["completion_tokens"] == 120

    state = story.run(backend=rt, stream=True, temperature=0)
    whole = list(state.text_iter())
    assert "".join(whole) == state.text() == PROMPT + state["a"] + "\nEnd."


def test_text_iter_after_the_stream_began():
    @lmnb.function
    def three(s):
        s += "a" + gen("x") + "b" + gen("y")

    gate = threading.Event()
    backend = FakeBackend(reply="123456", gate=gate)
    state = three.run(backend=backend, stream=True)
    assert backend.first_piece.wait(GUARD_S)  # "x" is half streamed
    gate.set()
    assert "".join(state.text_iter("x")) == "123456"
    assert "".join(state.text_iter("y")) == "123456"
    assert "".join(state.text_iter()) == "a123456b123456"


def test_text_iter_with_meta_data_on_a_backend_reporting_meta_at_the_end():
    """A backend that does not stream meta info (`MetaInfoStreaming`): the chunks come with {}
    and the final meta info as a last ("", meta_info) pair; a select's chunk with its meta."""

    @lmnb.function
    def two(s):
        s += "a" + gen("x") + lmnb.select("pick", choices=["p", "q"])

    gate = threading.Event()
    backend = FakeBackend(reply="123456", gate=gate)
    state = two.run(backend=backend, stream=True)
    assert backend.first_piece.wait(GUARD_S)  # "12" is streamed, "34" waits for the gate
    pairs = state.text_iter("x", return_meta_data=True)
    assert next(pairs) == ("12", {})
    gate.set()
    assert list(pairs) == [("34", {}), ("56", {}), ("", {"completion_tokens": 6})]
    assert list(state.text_iter("pick", return_meta_data=True)) == [
        ("p", {"method": "token_length_normalized"})]
    # a finished variable: its whole text with its final meta info
    assert list(state.text_iter("x", return_meta_data=True)) == [
        ("123456", {"completion_tokens": 6})]


class MetaFirstBackend(TextOnlyFake):
    """A `MetaInfoStreaming` backend on a pool thread: "ab" with its meta info, then the last
    chunk's meta info (finished); `meta_sent` is set, and its text "cd" waits for `gate`."""

    streams_meta_info = True

    def __init__(self) -> None:
        super().__init__()
        self.meta_sent, self.gate = threading.Event(), threading.Event()

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 on_meta: Callable[[dict[str, Any]], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        assert on_delta is not None and on_meta is not None
        final = {"completion_tokens": 2, "finish_reason": {"type": "length"}}
        on_meta({"completion_tokens": 1, "finish_reason": None})
        on_delta("ab")
        on_meta(final)
        self.meta_sent.set()
        assert self.gate.wait(GUARD_S), "the test never opened the gate"
        on_delta("cd")
        return Generation("abcd", final)

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        return choices[0], {}


def test_text_iter_with_meta_data_attached_between_a_chunks_meta_and_its_text():
    """A reader that attaches after a chunk's meta info reached the program but before its text
    gets the text so far with the meta info that came with that text: the last chunk's (its
    finish_reason set) came with the text before it, and then again with its own text."""

    @lmnb.function
    def one(s):
        s += "Q:" + gen("x")

    backend = MetaFirstBackend()
    state = one.run(backend=backend, stream=True)
    assert backend.meta_sent.wait(GUARD_S)  # the reader's attach is queued on the loop after it
    pairs = state.text_iter("x", return_meta_data=True)
    assert next(pairs) == ("ab", {"completion_tokens": 1, "finish_reason": None})
    backend.gate.set()
    assert list(pairs) == [("cd", {"completion_tokens": 2, "finish_reason": {"type": "length"}})]


def test_a_local_backend_subclass_with_the_older_generate_signature_streams(rt):
    """A subclass overriding `generate` without `on_meta=` is not given it (its text streams;
    the meta info comes at the end, as from any backend that does not stream it)."""

    class Wrapping(LocalBackend):
        def generate(self, prompt: str, params: GenParams, *,
                     on_delta: Callable[[str], None] | None = None,
                     cancel: threading.Event | None = None) -> Generation:
            return super().generate(prompt, params, on_delta=on_delta, cancel=cancel)

    @lmnb.function
    def one(s):
        s += PROMPT + gen("a", max_tokens=4, temperature=0, ignore_eos=True)

    state = one.run(backend=Wrapping(rt), stream=True)
    pairs = list(state.text_iter("a", return_meta_data=True))
    assert "".join(chunk for chunk, _ in pairs) == state["a"]
    assert pairs[-1][1] == state.get_meta_info("a")
    assert all(meta == {} for _, meta in pairs[:-1])


# ---- run_batch, bind, backends -----------------------------------------------------------------
@lmnb.function
def qa(s, question: str):
    s += CONTEXT + "Answer briefly.\n"
    s += "Q: " + question + "\nA:" + gen("answer", max_tokens=4)


BATCH_CONTEXT = "Batch context: " + " ".join(f"fact{k}" for k in range(50)) + "\n"


@lmnb.function
def batch_qa(s, question: str):
    s += BATCH_CONTEXT
    s += "Q: " + question + "\nA:" + gen("answer", max_tokens=4)


def test_run_batch_in_order_with_the_prefix_cached_first(rt, capfd):
    try:
        from lmnb.lang.tracer import constant_prefix  # noqa: F401
    except ImportError:
        pytest.skip("run_batch needs lmnb.lang.tracer.constant_prefix, not written yet")
    wait_idle(rt, check_integrity=True)
    assert rt.flush_cache()
    questions = [f"What is {k} + {k}?" for k in range(16)]
    states = batch_qa.run_batch([{"question": q} for q in questions], backend=rt,
                                temperature=0, progress_bar=True)
    assert "16/16" in capfd.readouterr().err
    assert len(states) == 16
    prefix_tokens = len(rt.encode(BATCH_CONTEXT))
    for q, state in zip(questions, states, strict=True):
        prompt = BATCH_CONTEXT + "Q: " + q + "\nA:"
        assert state.text() == prompt + state["answer"]
        meta = state.get_meta_info("answer")
        assert meta["completion_tokens"] == 4
        assert meta["cached_tokens"] >= prefix_tokens - 1, (meta, prefix_tokens)
        assert state["answer"] == greedy(rt, prompt, 4)["text"]


def test_bind_and_argument_errors(rt):
    bound = qa.bind(question="Why?")
    state = bound.run(backend=rt, temperature=0)
    assert state.text().endswith("Q: Why?\nA:" + state["answer"])
    assert qa.arg_names == ["question"] and "question" in repr(qa)
    with pytest.raises(TypeError):
        qa.bind(nope=1)
    with pytest.raises(TypeError):
        qa.run(nope=1, backend=rt)
    with pytest.raises(TypeError):
        qa.run_batch([{"question": "a"}], backend=rt, nope=1)
    with pytest.raises(TypeError):
        lmnb.function(lambda: None)


def test_backend_per_call_default_and_none(rt, no_default_backend):
    @lmnb.function
    def hello(s):
        s += PROMPT + gen("a", max_tokens=2)

    with pytest.raises(RuntimeError, match="no backend"):
        hello.run()
    assert hello.run(backend=rt).get_meta_info("a")["completion_tokens"] == 2
    lmnb.set_default_backend(rt)  # a Runtime is accepted directly
    assert isinstance(default_backend_module._default_backend, LocalBackend)
    assert hello.run(temperature=0)["a"] == greedy(rt, PROMPT, 2)["text"]
    fake = FakeBackend(reply="zz")
    assert hello.run(backend=fake)["a"] == "zz"  # per call wins over the default


def test_a_backend_source_default_gives_each_run_its_current_backend(no_default_backend):
    """A default that stands for another backend (the kernel's, following `%lmnb load`) gives
    every run, and SGLang's backend calls, the backend current when they start."""

    class Source:
        def __init__(self) -> None:
            self.current = FakeBackend(reply="one")

        def current_backend(self) -> Backend:
            return self.current

    @lmnb.function
    def hello(s):
        s += "Hi" + gen("a")

    source = Source()
    lmnb.set_default_backend(source)
    assert lmnb.default_backend() is source and hello.run()["a"] == "one"
    source.current = FakeBackend(reply="two")
    state = hello.run()
    assert state["a"] == "two" and state.executor.backend is source.current


# ---- the interpreter ----------------------------------------------------------------------------
def test_submitting_never_blocks():
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    body_done = threading.Event()

    @lmnb.function
    def three(s):
        for k in range(3):
            s += f"{k}:" + gen(f"g{k}")
        body_done.set()

    state = call_with_timeout(lambda: three.run(backend=backend, stream=True))
    # The first gen is held mid-stream by the gate, yet the function body has finished.
    assert body_done.wait(GUARD_S) and backend.first_piece.wait(GUARD_S)
    assert len(backend.calls) == 1 and backend.calls[0].end == 0.0
    gate.set()
    state.text()
    assert len(backend.calls) == 3
    calls = backend.calls
    assert all(a.end <= b.start for a, b in itertools.pairwise(calls))  # one after the other


SYNC_CALL_PREFIX = "lmnb-sync-call_"  # the program loop's one pool for blocking backend calls


def test_no_threads_leak():
    """Programs leave no thread behind. The program loop's pool for blocking backend calls is left
    out of the count: it keeps its threads for reuse and grows only while calls overlap, which
    depends on timing (under load two forks' calls overlapped and it grew by one: a failure). Its
    thread names stay distinct: a pool made per program would repeat `lmnb-sync-call_0`. The
    shared program loop is started first: it lives as long as the process, whichever test starts
    it."""
    program_loop()

    def settled_count() -> int:
        gc.collect()
        time.sleep(0.1)
        return sum(not t.name.startswith(SYNC_CALL_PREFIX) for t in threading.enumerate())

    @lmnb.function
    def failing(s):
        s += "x" + gen("a")
        raise ValueError("boom")

    before = settled_count()
    for k in range(20):
        if k % 4 == 0:
            state = branches.run(width=2, backend=FakeBackend())
        elif k % 4 == 1:
            state = failing.run(backend=FakeBackend(), stream=True)
        elif k % 4 == 2:
            state = qa.run(question="q", backend=FakeBackend(error=InvalidRequestError("no")))
        else:
            state = qa.run(question="q", backend=FakeBackend(), stream=True)
        state.error()
    del state
    deadline = time.monotonic() + GUARD_S
    while settled_count() > before:
        assert time.monotonic() < deadline, (
            f"{settled_count() - before} threads left: {threading.enumerate()}")
    pool = [t.name for t in threading.enumerate() if t.name.startswith(SYNC_CALL_PREFIX)]
    assert len(pool) == len(set(pool)), pool


def test_abort_frees_the_runtime_request(rt):
    @lmnb.function
    def long(s):
        s += PROMPT + gen("long", max_tokens=480, ignore_eos=True) + gen("after")

    state = long.run(backend=rt, stream=True)
    next(iter(state.text_iter("long")))  # it is generating
    assert rt.stats()["running"] == 1
    state.abort()
    assert isinstance(state.error(), ProgramAborted)
    with pytest.raises(ProgramError):
        state["after"]
    wait_idle(rt, check_integrity=True)
    assert rt.stats()["protected_tokens"] == 0
    assert_usable(rt)


class InterruptingBackend(LocalBackend):
    """At its first streamed text, interrupts the main thread and holds the program until the
    interrupt has aborted it: the run cannot end before the interrupt lands."""

    def __init__(self, runtime: lmnb.Runtime) -> None:
        super().__init__(runtime)
        self.interrupted = threading.Event()
        self.cancelled = False

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        def delta(text: str) -> None:
            if not self.interrupted.is_set():
                self.interrupted.set()
                _thread.interrupt_main()
                self.cancelled = cancel.wait(60)  # only a broken abort waits this long
            if on_delta is not None:
                on_delta(text)

        return super().generate(prompt, params, on_delta=delta, cancel=cancel)


def test_keyboard_interrupt_aborts_a_blocking_run(rt, default_sigint):
    states = []

    @lmnb.function
    def long(s):
        states.append(s)
        s += PROMPT + gen("long", max_tokens=480, ignore_eos=True)

    backend = InterruptingBackend(rt)
    with pytest.raises(KeyboardInterrupt):
        long.run(backend=backend)
    assert backend.interrupted.is_set() and backend.cancelled
    assert isinstance(states[0].error(), ProgramAborted)
    # the runtime's request is aborted (or done): its KV is released
    wait_idle(rt, check_integrity=True)
    assert rt.stats()["protected_tokens"] == 0
    assert_usable(rt)


def test_fork_item_augmented_assignment():
    backend = FakeBackend()

    @lmnb.function
    def indexed(s):
        forks = s.fork(2)
        forks[0] += "left"
        forks[1] += "right"
        forks.join(mode="concat_and_append")

    assert indexed.run(backend=backend).text() == "leftright"
    with pytest.raises(TypeError):
        indexed.run(backend=backend).fork(2)[0] = None
