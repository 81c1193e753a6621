"""Tracing programs into graphs and running them compiled: with greedy decoding on a tiny random
Llama, a compiled run gives the same text, variables and messages as the interpreter's run."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import lmnb
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.compiler import CompiledProgram
from lmnb.lang.interpreter import ProgramError
from lmnb.lang.ir import Argument, ForkItem, Gen, GenParams, Join, Text, Variable
from lmnb.lang.program import ProgramState
from lmnb.lang.tracer import Fork, SymbolicTextError, TracingError, constant_prefix

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[lmnb.Runtime]:
    runtime = lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=4096)
    yield runtime
    runtime.close()


def same_run(program: lmnb.Program, rt: lmnb.Runtime, **kwargs) -> ProgramState:
    """Runs `program` interpreted and compiled; asserts equal results; returns the compiled one."""
    expected = program.run(backend=rt, **GREEDY, **kwargs)
    compiled = program.compile()
    state = compiled.run(backend=rt, **GREEDY, **kwargs)
    assert type(state) is ProgramState
    assert state.error() is None, state.error()
    assert state.text() == expected.text()
    assert state.variables() == expected.variables()
    assert state.messages() == expected.messages()
    assert state.ret_value == expected.ret_value
    return state


# ---- programs ------------------------------------------------------------------------------------
@lmnb.function
def multi_turn(s, first, second):
    s += lmnb.system("You are a terse assistant.")
    s += lmnb.user(first)
    s += lmnb.assistant(lmnb.gen("answer_1", max_tokens=6))
    with s.user():
        s += second
    with s.assistant():
        s += lmnb.gen("answer_2", max_tokens=6)


@lmnb.function
def concat_args(s, question, topic, style="plain"):
    s += "Q: " + question + "\n"
    s += "Topic: " + topic + ", style " + style + ".\n"
    s += lmnb.gen("answer", max_tokens=5, stop=[topic])
    s += "\nDone with " + topic


@lmnb.function
def echo(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += lmnb.gen("a", max_tokens=5)
    s += "\nYou said " + s["a"]
    s += "\nTwice: " + s["a"] + "|" + s["a"] + "\n"
    s.set_var("copy", s["a"])
    s += lmnb.gen("b", max_tokens=4)
    return s["b"]


@lmnb.function
def branches(s, topic):
    s += "Three ideas about " + topic + ":\n"
    forks = s.fork(3)
    forks += lambda i: f"Idea {i + 1}:"
    forks += [" short", " long", " odd"]
    forks += lmnb.gen("idea", max_tokens=4)
    forks.join("gather_variable")
    s += "\nBest: " + forks[1]["idea"]
    pair = s.fork(2)
    pair += ["\nPro:", "\nCon:"]
    pair += lmnb.gen("point", max_tokens=3)
    s.join(pair, mode="concat_and_append")
    s += "\nSummary:" + lmnb.gen("summary", max_tokens=4)


@lmnb.function
def nested(s, topic):
    s += "About " + topic + "."
    outer = s.fork(2)
    outer += lmnb.gen("x", max_tokens=2)
    inner = outer[0].fork(2)
    inner += lambda i: f" [{i}]" + lmnb.gen("y", max_tokens=2)
    outer[0].join(inner, "concat_and_append")
    outer.join("gather_variable")
    s += " Then " + outer[0]["x"]


@lmnb.function
def scoped(s, name):
    s += "Name: " + name + "\n"
    with s.var_scope("bio"):
        s += "Bio: " + lmnb.gen("detail", max_tokens=4) + "."
    s += "\nAgain: " + s["bio"]


@lmnb.function
def choose(s, question):
    s += lmnb.user("Is this right? " + question)
    with s.assistant():
        s += lmnb.select("verdict", ["yes", "no", "maybe"])
    s += lmnb.user("Why " + s["verdict"] + "?")
    s += lmnb.assistant(lmnb.gen("why", max_tokens=4))


@lmnb.function
def few_shot(s, question):
    s += lmnb.system("Answer with one word.")
    s += "Q: Capital of France?\nA: Paris\nQ: Capital of Italy?\nA: Rome\n"
    s += lmnb.user("Q: " + question)
    s += lmnb.assistant(lmnb.gen("answer", max_tokens=4))


@lmnb.function
def starts_with_argument(s, question):
    s += question
    s += lmnb.gen("answer", max_tokens=4)


@lmnb.function
def branchy(s, question):
    s += question + lmnb.gen("a", max_tokens=3)
    if s["a"] == "yes":
        s += "Good."


# ---- compiled == interpreted ---------------------------------------------------------------------
def test_multi_turn_roles(rt) -> None:
    state = same_run(multi_turn, rt, first="Hi there.", second="And then?")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user",
                                                      "assistant"]


def test_argument_concatenation(rt) -> None:
    state = same_run(concat_args, rt, question="Why is the sky blue?", topic="light")
    assert "Q: Why is the sky blue?\nTopic: light, style plain.\n" in state.text()
    same_run(concat_args, rt, question="Why?", topic="sea", style="bold")


def test_variables_read_into_later_text(rt) -> None:
    state = same_run(echo, rt, question="Say something.")
    assert f"\nYou said {state['a']}" in state.text()
    assert state["copy"] == state["a"] and state.ret_value == state["b"]


def test_fork_gather_and_concat_joins(rt) -> None:
    state = same_run(branches, rt, topic="rivers")
    assert len(state["idea"]) == 3
    assert state.text().count("Pro:") == 1 and state.text().count("Con:") == 1


def test_nested_forks(rt) -> None:
    state = same_run(nested, rt, topic="cats")
    assert len(state["x"]) == 2


def test_var_scope(rt) -> None:
    state = same_run(scoped, rt, name="Ada")
    assert state["bio"].startswith("Bio: ")


def test_select(rt) -> None:
    state = same_run(choose, rt, question="2 + 2 = 4")
    assert state["verdict"] in ("yes", "no", "maybe")


def test_stream_run_and_batch(rt) -> None:
    compiled = echo.compile()
    streamed = compiled.run(question="Stream this.", backend=rt, stream=True, **GREEDY)
    assert "".join(streamed.text_iter("a")) == streamed["a"]
    expected = echo.run(question="Stream this.", backend=rt, **GREEDY)
    assert streamed.text() == expected.text() and streamed.ret_value == expected.ret_value
    questions = [{"question": q} for q in ("One?", "Two?", "Three?")]
    batch = compiled.run_batch(questions, backend=rt, progress_bar=False, **GREEDY)
    interpreted = echo.run_batch(questions, backend=rt, progress_bar=False, **GREEDY)
    assert [s.text() for s in batch] == [s.text() for s in interpreted]


def test_arguments_defaults_and_errors(rt) -> None:
    compiled = concat_args.compile()
    with pytest.raises(TypeError, match="missing required arguments \\['topic'\\]"):
        compiled.run(question="Why?", backend=rt)
    with pytest.raises(TypeError, match="no arguments|unexpected keyword"):
        compiled.run(question="Why?", topic="x", colour="red", backend=rt)
    bound = concat_args.bind(style="fancy").compile()
    assert "style fancy" in bound.run(question="Why?", topic="x", backend=rt, **GREEDY).text()
    with pytest.raises(TypeError, match="bound"):
        bound.run(question="Why?", topic="x", style="other", backend=rt)


def test_errors_surface_where_the_state_is_read(rt) -> None:
    @lmnb.function
    def missing(s):
        s += "Hello" + lmnb.gen("a", max_tokens=2)
        s += " and " + s["nope"]

    state = missing.compile().run(backend=rt, **GREEDY)
    with pytest.raises(ProgramError, match="nope"):
        state.text()


def test_abort_reaches_every_branch(rt) -> None:
    @lmnb.function
    def long(s, question):
        s += question
        forks = s.fork(2)
        forks += lmnb.gen("g", max_tokens=480, ignore_eos=True)  # fits the 512 context
        forks.join()
        s += " after: " + s["g"]

    state = long.compile().run(question="Hello", backend=rt, stream=True, **GREEDY)
    deadline = time.monotonic() + 60  # bounds a failing test only
    while rt.stats()["running"] < 2:  # both branches are generating
        assert time.monotonic() < deadline, rt.stats()
        time.sleep(0.02)
    state.abort()
    assert "interrupted" in repr(state.error())
    deadline = time.monotonic() + 60
    while rt.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.stats()["running"] == 0


# ---- tracing -------------------------------------------------------------------------------------
def test_trace_nodes_and_printing() -> None:
    traced = branches.trace()
    assert traced.arguments == ("topic",)
    first = traced.nodes(0)
    assert first[:4] == (Text("Three ideas about "), Argument("topic"), Text(":\n"),
                         Fork(0, (1, 2, 3)))
    assert traced.nodes(1)[0] == ForkItem(0, 0, 0)
    assert Join((1, 2, 3), "gather_variable") in first
    assert Variable("idea", 2) in first
    assert traced.nodes(2)[-1] == Gen("idea", GenParams(max_new_tokens=4))
    assert traced.variables[0] == ("idea", "summary")
    assert traced.variables[4] == ("point",)
    assert len(traced.states) == 6 and traced.states[4].parent == 0

    text = str(branches.compile())
    assert text.startswith("state 0:\n  text 'Three ideas about '\n  argument topic\n"
                           "  text ':\\n'\n  fork #0 -> states 1, 2, 3\n")
    for line in ("state 1 (fork #0 branch 0 of state 0):", "  text 'Idea 1:'",
                 "  gen idea (max_new_tokens=4)", "  join gather_variable <- states 1, 2, 3",
                 "  variable idea of state 2", "  fork #1 -> states 4, 5",
                 "  join concat_and_append <- states 4, 5"):
        assert line in text.splitlines(), line


def test_trace_roles_arguments_and_scopes() -> None:
    lines = str(multi_turn.trace()).splitlines()
    assert lines[:4] == ["state 0:", "  system begin", "  text 'You are a terse assistant.'",
                         "  system end"]
    assert "  argument first" in lines and "  gen answer_2 (max_new_tokens=6)" in lines
    assert "  var_scope bio end" in str(scoped.trace())
    assert "  select verdict ['yes', 'no', 'maybe'] (token_length_normalized)" in \
        str(choose.trace()).splitlines()
    assert "  set_var copy = {s0.a}" in str(echo.trace()).splitlines()
    assert str(echo.trace()).endswith("returns {s0.b}")
    given = concat_args.trace(question="Why?")
    assert given.arguments == ("topic", "style") and "  text 'Q: Why?\\n'" in str(given)


def test_data_dependent_control_flow_fails_clearly() -> None:
    with pytest.raises(TracingError, match="data-dependent control flow: variable 'a' of state 0"):
        branchy.compile()

    @lmnb.function
    def loops(s, examples):
        for example in examples:
            s += example

    @lmnb.function
    def measures(s, question):
        s += "x" * len(question)

    @lmnb.function
    def truthy(s, question):
        if question:
            s += question

    @lmnb.function
    def converts(s, count):
        s += lmnb.gen("a", max_tokens=int(count))

    for program, use in ((loops, "iterated"), (measures, "len()"), (truthy, "truth value"),
                         (converts, "int()")):
        with pytest.raises(TracingError, match=f"argument '.*' is .*{use}"):
            program.compile()


def test_symbolic_values_as_plain_data() -> None:
    @lmnb.function
    def data(s, name, count):
        s += lmnb.gen("a", max_tokens=count)
        s += name + "!" + s["a"]
        assert s["a"] == s["a"] and s["a"] != Variable("a", 1)
        {s["a"]: 1}  # hashable
        assert "argument 'name'" in repr(name)

    nodes = data.trace().nodes(0)
    assert nodes[0] == Gen("a", GenParams(max_new_tokens=Argument("count")))
    assert nodes[1:4] == (Argument("name"), Text("!"), Variable("a", 0))
    assert isinstance(data.compile(), CompiledProgram)


def test_symbolic_values_in_python_strings_raise_type_error(rt) -> None:
    """As SGLang: a value not known while tracing cannot become a Python string (string
    operations on a stand-in would trace a wrong graph); running the program is unaffected."""

    @lmnb.function
    def fstring(s, question):
        s += "Answer briefly.\n"
        s += f"Q: {question}\nA:" + lmnb.gen("answer", max_tokens=2)

    @lmnb.function
    def converted(s, question):
        s += "Q: " + str(question)

    @lmnb.function
    def formatted(s, question):
        s += "Q: {}".format(question)  # noqa: UP032 (format() is the case tested)

    @lmnb.function
    def variable(s):
        s += "Q:" + lmnb.gen("a", max_tokens=2)
        s += f"You said {s['a']}"

    cases = ((fstring, "argument 'question' inside an f-string"),
             (converted, "argument 'question' inside str()"),
             (formatted, "argument 'question' inside an f-string or format()"),
             (variable, "variable 'a' of state 0 inside an f-string"))
    for program, message in cases:
        with pytest.raises(TypeError, match=message) as info:
            program.trace()
        assert isinstance(info.value, SymbolicTextError)
        with pytest.raises(TypeError, match=message):
            program.compile()
    # The constant head before the f-string still caches, and the program runs.
    assert constant_prefix(fstring, LocalBackend(rt)) == "Answer briefly.\n"
    state = fstring.run(question="Why?", backend=rt, **GREEDY)
    assert state.text().startswith("Answer briefly.\nQ: Why?\nA:")
    assert fstring.trace(question="Why?").nodes(0)[1] == Text("Q: Why?\nA:")


# ---- constant prefix -----------------------------------------------------------------------------
def test_constant_prefix(rt) -> None:
    backend = LocalBackend(rt)
    template = backend.chat_template
    expected = (template.role_text("system", first=True).prefix + "Answer with one word."
                + template.role_text("system", first=False).suffix
                + "Q: Capital of France?\nA: Paris\nQ: Capital of Italy?\nA: Rome\n"
                + template.role_text("user", first=False).prefix + "Q: ")
    assert constant_prefix(few_shot, backend) == expected
    assert few_shot.run(question="Spain?", backend=rt, **GREEDY).text().startswith(expected)
    assert constant_prefix(starts_with_argument, backend) == ""
    assert constant_prefix(branchy, backend) == ""

    @lmnb.function
    def checks_argument(s, question):
        s += "Shared instructions. "
        if question:  # control flow on an argument: tracing stops here, the head stays
            s += question

    assert constant_prefix(checks_argument, backend) == "Shared instructions. "
    states = few_shot.compile().run_batch([{"question": "Spain?"}, {"question": "Peru?"}],
                                          backend=rt, progress_bar=False, **GREEDY)
    assert all(state.text().startswith(expected) for state in states)
