"""The paper's Figure 2 program (multi-dimensional judge, branch-solve-merge; the image is described
in words) and a batch of 64 small programs, on the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

import lmnb
from lmnb import assistant, gen, system, user

pytestmark = pytest.mark.slow
GRADE_REGEX = r"[A-D][+-]?"

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
IMAGE = "A golden retriever leaps to catch a red frisbee in a sunny park."
ESSAY = ("The picture captures a dog in the middle of a jump, catching a frisbee. Dogs love to "
         "play, and fetch keeps them healthy. The sunny park shows how outdoor play brings joy "
         "to pets and their owners.")


@pytest.fixture(scope="module")
def rt() -> Iterator[lmnb.Runtime]:
    with lmnb.Runtime(max_total_tokens=8192) as runtime:
        yield runtime


def choices_module_ready() -> None:
    try:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice  # noqa: F401
    except ImportError:
        pytest.skip("select needs lmnb/lang/choices.py, not written yet")


@lmnb.function
def multi_dimensional_judge(s, essay: str):
    s += system("Evaluate an essay about an image. The image is described in words.")
    s += user("Image: " + IMAGE + "\nEssay: " + essay)
    s += assistant("Sure!")
    # Return directly if it is not related
    s += user("Is the essay related to the image? Answer yes or no.")
    s += assistant(lmnb.select("related", ["yes", "no"]))
    if s["related"] == "no":
        return None
    # Judge each dimension in its own branch
    s.set_var("shared", s.text())
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS, strict=True):
        f += user("Evaluate based on the following dimension: " + dim
                  + ". End your judgment with the word END.")
        f += assistant("Judgment: " + gen("judgment", max_tokens=48, stop="END"))
    s.set_var("judgment_meta", [f.get_meta_info("judgment") for f in forks])
    # Merge the judgments
    judgment = "\n".join(f"{dim}: {f['judgment'].strip()}"
                         for f, dim in zip(forks, DIMENSIONS, strict=True))
    s += user("Provide the judgment, summary, and a letter grade.")
    with s.assistant():
        s += judgment + "\n"
        s += "Summary: " + gen("summary", max_tokens=48, stop="\n")
        # A regex for the letter comes with constrained decoding.
        s += "\nGrade: " + gen("grade", max_tokens=8, regex=GRADE_REGEX)  # the paper's final regex
    return s["grade"]


def test_figure2_multi_dimensional_judge(rt):
    choices_module_ready()
    state = multi_dimensional_judge.run(essay=ESSAY, backend=rt, temperature=0)
    assert state["related"] == "yes"  # the essay is about the described picture
    judgments = state["judgment_meta"]
    assert len(judgments) == 3
    shared_tokens = len(rt.encode(state["shared"]))
    for meta in judgments:  # the fork's shared prefix was cached before the branches ran
        assert meta["cached_tokens"] >= shared_tokens - 1, (meta, shared_tokens)
        assert meta["finish_reason"]["type"] in ("stop", "length")
    assert isinstance(state["summary"], str) and re.fullmatch(GRADE_REGEX, state["grade"])
    assert state.ret_value == state["grade"]
    text = state.text()
    assert "\nSummary: " + state["summary"] + "\nGrade: " + state["grade"] in text
    assert state.messages()[-1]["role"] == "assistant"
    assert text == rt.tokenizer.apply_chat_template(state.executor.messages_, tokenize=False)
    assert [m["content"] for m in state.messages()] == \
        [m["content"].lstrip() for m in state.executor.messages_]
    assert rt.stats()["running"] == 0
    rt.check_integrity()


SHORT_SYSTEM = "You are a concise assistant. Answer every question in a few words."


@lmnb.function
def short_answer(s, question: str):
    s += system(SHORT_SYSTEM)
    s += user(question)
    s += assistant(gen("answer", max_tokens=8))


def test_run_batch_of_64_with_the_prefix_hint(rt, capfd):
    try:
        from lmnb.lang.tracer import constant_prefix  # noqa: F401
    except ImportError:
        pytest.skip("run_batch needs lmnb.lang.tracer.constant_prefix, not written yet")
    questions = [f"What is {a} plus {b}?" for a in range(8) for b in range(8)]
    stats = rt.stats()
    states = short_answer.run_batch([{"question": q} for q in questions], backend=rt,
                                    temperature=0, progress_bar=True)
    assert "64/64" in capfd.readouterr().err
    system_tokens = len(rt.encode(rt.tokenizer.apply_chat_template(
        [{"role": "system", "content": SHORT_SYSTEM}], tokenize=False)))
    for question, state in zip(questions, states, strict=True):
        assert state.messages()[1] == {"role": "user", "content": question}
        meta = state.get_meta_info("answer")
        assert 1 <= meta["completion_tokens"] <= 8
        assert meta["cached_tokens"] >= system_tokens - 1, (meta, system_tokens)
    after = rt.stats()
    assert after["cached_tokens"] - stats["cached_tokens"] >= 64 * (system_tokens - 1)
    rt.check_integrity()
