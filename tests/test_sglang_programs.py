"""More SGLang frontend programs run unchanged through `import lmnb as sgl` (written for this test
in SGLang's style): `separate_reasoning`, one `@function` calling another (run, traced and
compiled), `messages()` stripping, select's meta_info fields. On a tiny random-weight Llama; the
reasoning outputs are shaped by a regex so that the random model writes them."""

from __future__ import annotations

import pytest

import lmnb as sgl

THINK = r"<think>[a-z]{2,6}</think>[A-Z][a-z]{1,5}"  # qwen3: with the opening tag
R1 = r"[a-z]{2,6}</think>[A-Z][a-z]{1,5}"  # deepseek-r1: no opening tag


# ---- separate_reasoning -------------------------------------------------------------------------
@sgl.function
def reasoner(s, question):
    s += sgl.system("Think first, then answer.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=24, regex=THINK),
                                              model_type="qwen3"))
    s += "\nIn short:" + sgl.separate_reasoning(
        sgl.gen("short", max_tokens=24, regex=R1), model_type="deepseek-r1")


def test_separate_reasoning_as_sglang(sgl_backend):
    state = reasoner.run(question="What colour is the sky?", temperature=0)
    answer, thought = state["answer"], state["answer_reasoning_content"]
    assert thought.isalpha() and thought.islower() and answer[:1].isupper()
    assert "<think>" not in state.text() and "</think>" not in state.text()
    assert state.messages()[-1] == {"role": "assistant", "content": answer}
    assert state["short"][:1].isupper() and state["short_reasoning_content"].islower()
    assert state.text().endswith("\nIn short:" + state["short"])
    # The spans of the variables cover the answers only.
    text = state.text()
    assert {name: text[start:end] for name, start, end in state.spans()} == \
        {"answer": answer, "short": state["short"]}

    compiled = reasoner.compile().run(question="What colour is the sky?", temperature=0)
    assert compiled.text() == state.text()
    assert compiled["answer_reasoning_content"] == thought
    assert "separate_reasoning qwen3" in str(reasoner.trace())


def test_separate_reasoning_arguments():
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="no-such-model")
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")
    from lmnb.lang.reasoning import split_reasoning

    assert split_reasoning("no reasoning here", "qwen3") == ("no reasoning here", "")
    assert split_reasoning("still thinking", "deepseek-r1") == ("", "still thinking")
    assert split_reasoning(["<think>a</think>B", "C"], "qwen3") == (["B", "C"], ["a", ""])


def test_separate_reasoning_strips_as_sglangs_parser():
    from lmnb.lang.reasoning import split_reasoning

    # As SGLang's detect_and_parse: start markers dropped, the text and the answer stripped
    # (was: answer "\n\nFour.", reasoning "\nTwo and two.\n")
    assert split_reasoning("<think>\nTwo and two.\n</think>\n\nFour.", "qwen3") == (
        "Four.", "Two and two.\n")
    assert split_reasoning("\nTwo and two.\n</think>\n\nFour.\n", "deepseek-r1") == (
        "Four.", "Two and two.\n")
    assert split_reasoning("  <think>\ncut off ", "qwen3") == ("", "cut off")
    assert split_reasoning(" plain answer ", "qwen3") == (" plain answer ", "")


# ---- a @function calling another ----------------------------------------------------------------
@sgl.function
def expert_answer(s, topic, style="in one word"):
    s += "Describe " + topic + " " + style + ":" + sgl.gen("description")


@sgl.function
def panel(s, topic):
    s += "Panel on " + topic + ".\nChair:" + sgl.gen("chair", max_tokens=3)
    first = expert_answer(topic=topic)  # SGLang's nested call: a program of its own
    second = expert_answer(topic=topic, style="briefly", max_new_tokens=2)  # its own default
    s += "\nExpert 1:" + first["description"] + "\nExpert 2:" + second["description"]
    s += "\nChair:" + sgl.gen("closing", max_tokens=3)


def test_nested_function_runs_traces_and_compiles(sgl_backend):
    state = panel.run(topic="tea", temperature=0, max_new_tokens=4)  # the called ones' too
    alone = expert_answer.run(topic="tea", temperature=0, max_new_tokens=4)
    assert f"\nExpert 1:{alone['description']}\n" in state.text()
    second = expert_answer.run(topic="tea", style="briefly", temperature=0, max_new_tokens=2)
    assert f"\nExpert 2:{second['description']}\n" in state.text()

    traced = panel.trace()
    assert [s.call for s in traced.states] == [None, "expert_answer", "expert_answer"]
    assert "call expert_answer -> state 1" in str(traced)
    assert traced.last_node == traced.nodes()[-1]
    compiled = panel.compile(backend=sgl_backend).run(topic="tea", temperature=0, max_new_tokens=4)
    assert compiled.text() == state.text()

    batch = panel.compile().run_batch([{"topic": "tea"}, ("coffee",)], temperature=0,
                                      max_new_tokens=4)
    assert batch[0].text() == state.text()
    assert batch[1].text() == panel.run(topic="coffee", temperature=0, max_new_tokens=4).text()


def test_nested_call_errors_and_subroutines(sgl_backend):
    @sgl.function
    def broken(s):
        s += "x" + sgl.gen("y", max_tokens=1, regex="[")  # an invalid regex fails at the runtime

    @sgl.function
    def caller(s):
        s += "a"
        broken()  # fails the caller even though it never reads the called program's state

    with pytest.raises(Exception, match="regex"):
        caller.run()
    with pytest.raises(Exception, match="regex"):
        caller.compile().run().text()

    @sgl.function
    def with_subroutine(s):
        s += "Topic: tea. "
        expert_answer(s, "tea")  # given the state, the body writes into it
        s += "!"

    state = with_subroutine.run(temperature=0, max_new_tokens=3)
    assert state.text() == "Topic: tea. Describe tea in one word:" + state["description"] + "!"
    assert with_subroutine.compile().run(temperature=0, max_new_tokens=3).text() == state.text()


# ---- messages, select meta_info -----------------------------------------------------------------
def test_messages_strip_leading_whitespace_as_sglang(sgl_backend):
    @sgl.function
    def chat(s):
        s += sgl.user("  Hello there")
        s += sgl.assistant("\n Hi!")

    state = chat.run()
    assert state.messages() == [{"role": "user", "content": "Hello there"},
                                {"role": "assistant", "content": "Hi!"}]
    assert state.text() == sgl_backend.apply_chat_template(state.executor.messages_,
                                                           add_generation_prompt=False)


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_meta_info_fields_as_sglang(sgl_backend, method):
    @sgl.function
    def pick(s):
        s += "The sky is"
        s += sgl.select("colour", choices=[" blue", " dark green"], choices_method=method)

    meta = pick.run().get_meta_info("colour")
    assert {"normalized_prompt_logprobs", "input_token_logprobs",
            "output_token_logprobs"} <= set(meta)
    assert meta["output_token_logprobs"] == [[], []]
    tokenizer = sgl_backend.get_tokenizer()
    for row in meta["input_token_logprobs"]:  # (logprob, token_id, text) per token
        assert all(text == tokenizer.decode([token]) for _, token, text in row)
    assert "".join(text for _, _, text in meta["input_token_logprobs"][1]).endswith("green")
    if method == sgl.greedy_token_selection:
        assert len(meta["greedy_logprob_matrix"]) == 2
    if method == sgl.unconditional_likelihood_normalized:
        assert len(meta["unconditional_token_logprobs"][0][0]) == 3
        assert len(meta["normalized_unconditional_prompt_logprobs"]) == 2
