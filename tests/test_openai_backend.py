"""`lmnb.OpenAI` against an in-process OpenAI-compatible endpoint (tests/fake_openai.py): gens on
completion and chat models, streaming, stops, select by logprobs, usage, API speculation."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")

import lmnb  # noqa: E402
from lmnb import assistant, function, gen, select, system, user  # noqa: E402
from lmnb.lang.backends.base import ChatPrompt  # noqa: E402
from tests.fake_openai import FakeEndpoint  # noqa: E402

DOCUMENT = ("Name: Harry Potter\nBirthday: July 31, 1980\nJob: Student at Hogwarts\n"
            "House: Gryffindor\nWand: Holly, phoenix feather\n")
INTRO = ("Below is a character sheet from the wiki of a fantasy novel series. Every field is "
         "filled in from the books, one per line, as the editors of the wiki agreed long ago "
         "when they wrote their style guide for all the character pages of the series.\n")
FIELDS = ("name", "birthday", "job", "house", "wand")


def character(s, labels=("Name", "Birthday", "Job", "House", "Wand")):
    """The paper's character description: several fields, each a gen ending at a newline."""
    s += INTRO
    for i, (label, name) in enumerate(zip(labels, FIELDS, strict=True)):
        s += ("\n" if i else "") + f"{label}:" + gen(name.lower(), stop="\n")


def character_chat(s):
    s += system("You fill in character sheets.")
    s += user(INTRO + "Fill in the sheet of Harry Potter.")
    s += assistant("Name:" + gen("name", stop="\n") + "\nBirthday:" + gen("birthday", stop="\n")
                   + "\nJob:" + gen("job", stop="\n") + "\nHouse:" + gen("house", stop="\n")
                   + "\nWand:" + gen("wand", stop="\n"))


def backend(endpoint: FakeEndpoint, *, chat: bool, **options) -> lmnb.OpenAI:
    return lmnb.OpenAI("fake-model", client=endpoint.client(), is_chat_model=chat, **options)


def run(program, endpoint: FakeEndpoint, *, chat: bool, spec: int | None = None,
        max_new_tokens: int | None = None, **options):
    prog = function(num_api_spec_tokens=spec)(program) if spec else function(program)
    api = backend(endpoint, chat=chat, **options)
    sampling = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
    state = prog.run(backend=api, temperature=0, **sampling)
    return state, api


def test_import_lmnb_does_not_import_openai():
    import subprocess
    import sys

    code = "import sys, lmnb; assert 'openai' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_completion_gen_stops_and_streams():
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    deltas: list[str] = []
    out = api.generate(INTRO + "Name:", lmnb.lang.ir.GenParams(stop=("\n",), max_new_tokens=64),
                       on_delta=deltas.append)
    assert out.text == " Harry Potter"
    assert len(deltas) > 1 and "".join(deltas) == out.text
    assert out.meta_info["finish_reason"] == {"type": "stop", "matched": "\n"}
    (call,) = endpoint.calls
    assert call.path == "completions" and call.body["stop"] == ["\n"]
    assert call.body["max_tokens"] == 64 and call.body["stream"] is True


def test_cancel_stops_a_streaming_gen():
    import threading

    from lmnb.lang.backends.base import ProgramAborted

    api = backend(FakeEndpoint(DOCUMENT), chat=False)
    cancel = threading.Event()
    deltas: list[str] = []

    def on_delta(delta: str) -> None:
        deltas.append(delta)
        cancel.set()

    with pytest.raises(ProgramAborted):
        api.generate("Name:", lmnb.lang.ir.GenParams(max_new_tokens=64), on_delta=on_delta,
                     cancel=cancel)
    assert len(deltas) == 1


class AbortingEndpoint(FakeEndpoint):
    def complete(self, text: str, body: dict) -> tuple[str, str, str | None, int]:
        return " Har", "abort", None, 2  # the server aborted the request (SGLang's reason)


@pytest.mark.parametrize("stream", [False, True])
def test_a_gen_the_server_aborted_fails_the_program(stream):
    from lmnb.lang.interpreter import ProgramError

    @function
    def name(s):
        s += INTRO + "Name:" + gen("name", stop="\n")

    state = name.run(backend=backend(AbortingEndpoint(DOCUMENT), chat=False), stream=stream)
    with pytest.raises(ProgramError, match="aborted the request"):
        state.text()


def test_params_pass_through_and_extensions_only_when_set():
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    params = lmnb.lang.ir.GenParams(max_new_tokens=8, temperature=0.5, top_p=0.9,
                                    frequency_penalty=0.1, presence_penalty=0.2, top_k=-1,
                                    seed=7, regex=r"[A-Z][a-z]+")
    api.generate("Name:", params)
    body = endpoint.calls[-1].body
    assert (body["temperature"], body["top_p"]) == (0.5, 0.9)
    assert (body["frequency_penalty"], body["presence_penalty"], body["seed"]) == (0.1, 0.2, 7)
    assert body["regex"] == r"[A-Z][a-z]+" and "top_k" not in body  # default: not sent

    chat = backend(endpoint, chat=True)
    state = function(lambda s: s.__iadd__(
        user("hi") + assistant(gen("x", json_schema={"type": "object"})))).run(backend=chat)
    state.text()
    body = endpoint.calls[-1].body
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_return_logprob_gives_token_texts():
    def completion(s):
        s += "Name:" + gen("x", stop="\n", return_logprob=True)

    def chat(s):
        s += user("hi") + assistant(gen("x", stop="\n", return_logprob=True))

    for program, expected in ((completion, " Harry Potter"), (chat, "Name: Harry Potter")):
        state, _ = run(program, FakeEndpoint(DOCUMENT), chat=program is chat)
        assert state["x"] == expected
        logprobs = state.get_meta_info("x")["output_token_logprobs"]
        assert "".join(text for _, _, text in logprobs) == expected


@pytest.mark.parametrize("chat", [False, True])
def test_n_samples_in_one_call(chat):
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=chat)
    params = lmnb.lang.ir.GenParams(n=3, stop=("\n",), max_new_tokens=32, return_logprob=True)
    if chat:  # the reply is the chat message's content
        out = api.generate("", params, chat=ChatPrompt(({"role": "user", "content": "Who?"},),
                                                       "assistant"))
        expected = "Name: Harry Potter"
    else:
        out = api.generate("Name:", params)
        expected = " Harry Potter"
    assert out.text == [expected] * 3
    assert [m["finish_reason"]["type"] for m in out.meta_info] == ["stop"] * 3
    for meta in out.meta_info:
        assert "".join(text for _, _, text in meta["output_token_logprobs"]) == expected
    (call,) = endpoint.calls
    assert call.body["n"] == 3 and "stream" not in call.body
    assert api.token_usage.completion_tokens == 3 * (len(expected) + 1)  # each billed its stop


def test_stop_regex_is_cut_client_side():
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    out = api.generate("Name:", lmnb.lang.ir.GenParams(stop_regex=(r"\d{4}",),
                                                       max_new_tokens=64))
    assert out.text == " Harry Potter\nBirthday: July 31, "
    assert out.meta_info["finish_reason"] == {"type": "stop", "matched": "1980"}


def test_chat_program_sends_messages():
    endpoint = FakeEndpoint(DOCUMENT)

    def qa(s):
        s += system("Be brief.")
        s += user("Who?")
        s += assistant(gen("answer", stop="\n", max_tokens=32))

    state, api = run(qa, endpoint, chat=True)
    assert state["answer"] == "Name: Harry Potter"
    assert state.messages()[-1] == {"role": "assistant", "content": "Name: Harry Potter"}
    (call,) = endpoint.calls
    assert call.path == "chat" and call.body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]


def test_chat_model_errors_name_the_fix():
    endpoint = FakeEndpoint(DOCUMENT)
    state, _ = run(lambda s: s.__iadd__("plain text" + gen("x")), endpoint, chat=True)
    with pytest.raises(lmnb.lang.interpreter.ProgramError, match="outside a role"):
        state.text()
    state, _ = run(character_chat, endpoint, chat=True)
    with pytest.raises(lmnb.lang.interpreter.ProgramError) as info:
        state.text()
    assert "num_api_spec_tokens" in str(info.value.__cause__)
    assert "continue_final_message" in str(info.value.__cause__)
    assert not endpoint.calls


def test_select_by_prompt_logprobs():
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    prompt = "Name: Harry Potter\nBirthday: July 31, 1980\nJob: Student at Hogwarts\nHouse:"
    for method in ("token_length_normalized", "greedy_token_selection"):
        choice, meta = api.select(prompt, (" Slytherin", " Gryffindor", " Hufflepuff"), method)
        assert choice == " Gryffindor" and meta["method"] == method
    body = endpoint.calls[-1].body
    assert body["echo"] is True and body["logprobs"] == 1 and len(body["prompt"]) == 3
    assert api.token_usage.calls == 2

    state = function(lambda s: s.__iadd__(prompt + select("house", [" Slytherin",
                                                                    " Gryffindor"]))).run(
        backend=api)
    assert state["house"] == " Gryffindor"


def test_select_without_logprobs_is_a_clear_error():
    api = backend(FakeEndpoint(DOCUMENT, logprobs=False), chat=False)
    with pytest.raises(ValueError, match="token_length_normalized.*logprobs"):
        api.select("House:", (" A", " B"), "token_length_normalized")
    api = backend(FakeEndpoint(DOCUMENT, echo=False), chat=False)
    with pytest.raises(ValueError, match="token_length_normalized.*refused.*echo"):
        api.select("House:", (" A", " B"), "token_length_normalized")
    chat = backend(FakeEndpoint(DOCUMENT), chat=True)
    with pytest.raises(ValueError, match="greedy_token_selection.*chat"):
        chat.select("House:", (" A", " B"), "greedy_token_selection")
    with pytest.raises(ValueError, match="unconditional_likelihood_normalized"):
        chat.select("House:", (" A", " B"), "unconditional_likelihood_normalized")


def test_token_usage_counts_every_call_across_threads():
    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    states = function(character).run_batch([{}] * 6, backend=api, temperature=0,
                                           num_threads=6, progress_bar=False)
    assert all(state["wand"] == " Holly, phoenix feather" for state in states)
    usage = api.token_usage.as_dict()
    assert usage["calls"] == len(endpoint.calls) == 6 * len(FIELDS)
    assert usage["prompt_tokens"] == endpoint.billed_prompt_tokens
    assert usage["completion_tokens"] == sum(c.completion_tokens for c in endpoint.calls)
    api.token_usage.reset()
    assert api.token_usage.as_dict() == {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    @function(num_api_spec_tokens=128)
    def speculative(s):
        character(s)

    for runner in (speculative, speculative.compile()):  # per state: one call per program
        api = backend(FakeEndpoint(DOCUMENT), chat=False)
        states = runner.run_batch([{}] * 6, backend=api, temperature=0, num_threads=6,
                                  progress_bar=False)
        assert [state["wand"] for state in states] == [" Holly, phoenix feather"] * 6
        assert api.token_usage.calls == 6


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_speculation_gives_the_same_fields_with_fewer_calls(chat):
    program = character_chat if chat else character
    options = {"continue_final_message": True} if chat else {}
    off_endpoint, on_endpoint = FakeEndpoint(DOCUMENT), FakeEndpoint(DOCUMENT)
    off, off_api = run(program, off_endpoint, chat=chat, **options)
    on, on_api = run(program, on_endpoint, chat=chat, spec=128, **options)
    fields = [off[name] for name in FIELDS]
    assert fields == [" Harry Potter", " July 31, 1980", " Student at Hogwarts", " Gryffindor",
                      " Holly, phoenix feather"]
    assert [on[name] for name in FIELDS] == fields
    assert on.text() == off.text()
    assert off_api.token_usage.calls == len(FIELDS) and on_api.token_usage.calls == 1
    assert 2 * on_api.token_usage.prompt_tokens <= off_api.token_usage.prompt_tokens
    assert on_api.token_usage.prompt_tokens == on_endpoint.billed_prompt_tokens
    (call,) = on_endpoint.calls
    assert "stop" not in call.body and call.body["max_tokens"] == 128
    assert on.get_meta_info("job")["speculative"] is True


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_speculation_mismatch_falls_back_to_a_real_call(chat):
    labels = ("Name", "Age", "Job", "House", "Wand")  # "Age" is not what the model writes next

    options = {"continue_final_message": True} if chat else {}
    off_endpoint, on_endpoint = FakeEndpoint(DOCUMENT), FakeEndpoint(DOCUMENT)

    def program(s):
        if chat:  # no text outside roles: the fields are the assistant's reply
            s += user("Fill in the sheet.")
            s += lmnb.assistant_begin()
        for i, (label, name) in enumerate(zip(labels, FIELDS, strict=True)):
            s += ("\n" if i else "") + f"{label}:" + gen(name, stop="\n")
        if chat:
            s += lmnb.assistant_end()

    off, _ = run(program, off_endpoint, chat=chat, **options)
    on, on_api = run(program, on_endpoint, chat=chat, spec=128, **options)
    assert [on[name] for name in FIELDS] == [off[name] for name in FIELDS]
    assert on["name"] == " Harry Potter" and on.text() == off.text()
    # The name is served from the first call; after "Age" every field needs a call of its own
    # (the model keeps writing the sheet from its start): on a completion model, a new
    # speculative call each time; in a chat turn, which speculates once, real calls.
    calls = [call.body.get("stop") for call in on_endpoint.calls]
    assert calls == [None] + ([["\n"]] * 4 if chat else [None] * 4)


def test_speculation_respects_the_budget_and_forks():
    endpoint = FakeEndpoint(DOCUMENT)

    def program(s):
        s += "Name:" + gen("name", stop="\n", max_tokens=8)  # the speculative call writes more
        s += "\nBirthday:" + gen("birthday", stop="\n")

    on, api = run(program, endpoint, chat=False, spec=64)
    assert on["name"] == " Harry P"  # cut by its own budget, through a real call
    assert api.token_usage.calls == 3

    @function(num_api_spec_tokens=64)
    def small_fields(s):  # each piece fits its budget, counted by the call's token texts
        s += "Name:" + gen("name", stop="\n", max_tokens=14)
        s += "\nBirthday:" + gen("birthday", stop="\n", max_tokens=15)
        s += "\nJob:" + gen("job", stop="\n", max_tokens=16)

    endpoint = FakeEndpoint(DOCUMENT)
    api = backend(endpoint, chat=False)
    on = small_fields.run(backend=api, temperature=0)
    assert (on["name"], on["birthday"]) == (" Harry Potter", " July 31, 1980")
    assert on["job"] == " Student at Hogw"  # 21 tokens to its stop: a real call, cut at 16
    assert api.token_usage.calls == 2
    assert endpoint.calls[0].body["logprobs"] == 0 and endpoint.calls[0].body["max_tokens"] == 64


def test_speculation_that_runs_out_speculates_again():
    endpoint = FakeEndpoint(DOCUMENT)
    off, _ = run(character, FakeEndpoint(DOCUMENT), chat=False, max_new_tokens=20)
    api = backend(endpoint, chat=False)
    on = function(num_api_spec_tokens=20)(character).run(backend=api, temperature=0,
                                                          max_new_tokens=20)
    assert [on[name] for name in FIELDS] == [off[name] for name in FIELDS]
    assert off["wand"] == " Holly, phoenix feat"  # its own budget ends it
    # 20-token calls: name + "\nBirthd" (does not match "\nBirthday:"), birthday + "\nJob: ",
    # job (runs out: a new call, ended by the budget), house + "\nWand: Ho", wand.
    assert [call.body["prompt"].rsplit("\n", 1)[1] for call in endpoint.calls] == [
        "Name:", "Birthday:", "Job:", "House:", "Wand:"]
