"""`lmnb.OpenAI` against the lmnb server (skipped where `lmnb.server` is absent): the same greedy
text as the local backend, and API speculation on a real model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("openai")
server = pytest.importorskip("lmnb.server")

import lmnb  # noqa: E402
from lmnb import assistant, function, gen, select, system, user  # noqa: E402
from lmnb.lang.backends.base import Backend  # noqa: E402
from lmnb.runtime.engine import Runtime  # noqa: E402


@function
def story(s, topic):
    s += f"A short note about {topic}.\nTitle:" + gen("title", stop="\n", max_tokens=12)
    s += "\nFirst line:" + gen("line", max_tokens=16)


@function
def qa(s, question):
    s += system("Answer briefly.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=16))


def serve(runtime: Runtime) -> Iterator[str]:
    with server.ServerHandle.start(runtime, served_model_name="m") as handle:
        yield f"{handle.url}/v1"


@pytest.fixture(scope="module")
def tiny(tiny_models) -> Iterator[tuple[Runtime, str]]:
    with Runtime(tiny_models["llama-gqa"], max_total_tokens=4096) as runtime:
        for url in serve(runtime):
            yield runtime, url


def test_api_and_local_backends_give_the_same_greedy_text(tiny):
    runtime, url = tiny
    local: Backend = lmnb.LocalBackend(runtime)
    assert isinstance(local, Backend)
    for program, chat, arguments in ((story, False, {"topic": "rain"}),
                                      (qa, True, {"question": "Why is the sky blue?"})):
        api = lmnb.OpenAI("m", base_url=url, is_chat_model=chat)
        over_api = program.run(backend=api, temperature=0, **arguments)
        in_process = program.run(backend=local, temperature=0, **arguments)
        assert over_api.variables() == in_process.variables()
        assert api.token_usage.calls == (2 if not chat else 1)


def test_select_over_the_api_picks_what_the_local_backend_picks(tiny):
    """`select` scores choices by completions with `echo` + `logprobs`, which the lmnb server
    refused (echo was a 400)."""
    runtime, url = tiny

    @function
    def pick(s):
        s += "The best colour is" + select("colour", choices=[" red", " green", " blue sky"])

    api = lmnb.OpenAI("m", base_url=url, is_chat_model=False)
    over_api = pick.run(backend=api)
    in_process = pick.run(backend=lmnb.LocalBackend(runtime))
    assert over_api["colour"] == in_process["colour"]
    assert over_api.get_meta_info("colour")["normalized_prompt_logprobs"] == pytest.approx(
        in_process.get_meta_info("colour")["normalized_prompt_logprobs"], abs=1e-4)


def test_a_gen_stopped_over_the_api_names_its_stop_as_the_local_backend_does(tiny):
    """The lmnb server sends SGLang's `matched_stop`, which `lmnb.OpenAI` reads into the gen's
    finish_reason: the same as in-process (it had no `matched`)."""
    runtime, url = tiny

    @function
    def first_word(s):
        s += "Once upon a time" + gen("word", max_tokens=8, stop=[" ", "e"])

    over_api = first_word.run(backend=lmnb.OpenAI("m", base_url=url, is_chat_model=False),
                              temperature=0)
    in_process = first_word.run(backend=lmnb.LocalBackend(runtime), temperature=0)
    reason = in_process.get_meta_info("word")["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in (" ", "e")
    assert over_api.get_meta_info("word")["finish_reason"] == reason
    assert over_api["word"] == in_process["word"]


def test_continue_final_message_continues_the_assistant_turn_on_the_lmnb_server(tiny):
    """A gen after text in `assistant()` with `continue_final_message=True`: the lmnb server
    continues that text as vLLM does (it ignored the flag and opened a new assistant turn)."""
    runtime, url = tiny

    @function
    def lead(s):
        s += user("Name a colour.")
        s += assistant("My favourite colour is" + gen("rest", max_tokens=8))

    api = lmnb.OpenAI("m", base_url=url, is_chat_model=True, continue_final_message=True)
    over_api = lead.run(backend=api, temperature=0)
    in_process = lead.run(backend=lmnb.LocalBackend(runtime), temperature=0)
    assert over_api["rest"] == in_process["rest"]


@pytest.mark.slow
def test_api_speculation_on_smollm2():
    def sheet(s):
        s += ("Character: Hermione Granger\nName: Hermione Jean Granger\nHouse: Gryffindor\n"
              "Pet: Crookshanks, a cat\n\nCharacter: Harry Potter\nName:")
        s += gen("name", stop="\n", max_tokens=16) + "\nHouse:"
        s += gen("house", stop="\n", max_tokens=16) + "\nPet:"
        s += gen("pet", stop="\n", max_tokens=16)

    with Runtime(max_total_tokens=4096) as runtime:
        for url in serve(runtime):
            off_api = lmnb.OpenAI("m", base_url=url, is_chat_model=False)
            on_api = lmnb.OpenAI("m", base_url=url, is_chat_model=False)
            off = function(sheet).run(backend=off_api, temperature=0)
            on = function(num_api_spec_tokens=48)(sheet).run(backend=on_api, temperature=0)
            assert on.variables() == off.variables()
            # Pieces sized by the server's token texts: served within each gen's 16 tokens.
            assert off_api.token_usage.calls == 3 and on_api.token_usage.calls < 3
            assert on_api.token_usage.prompt_tokens < off_api.token_usage.prompt_tokens
            assert any(on.get_meta_info(name).get("speculative") for name in ("house", "pet"))
