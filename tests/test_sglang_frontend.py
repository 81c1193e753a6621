"""SGLang's own frontend (the `sglang` package: `sgl.RuntimeEndpoint`, `@sgl.function`, gen,
select, regex, fork, stream, run_batch) against `lmnb serve` on 127.0.0.1, with a tiny
random-weight Llama. Greedy results must equal what lmnb's DSL gets from the same runtime in
process. The package is installed without its dependencies (`make venv`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import lmnb

sgl = pytest.importorskip("sglang", reason="SGLang's frontend: `make venv` installs it")


@pytest.fixture(scope="module")
def endpoint(sgl_runtime) -> Iterator[Any]:
    """SGLang's `RuntimeEndpoint` over an lmnb server, as SGLang's default backend."""
    from lmnb.server import ServerHandle

    with ServerHandle.start(sgl_runtime) as server:
        backend = sgl.RuntimeEndpoint(server.url)
        sgl.set_default_backend(backend)
        yield backend
        sgl.set_default_backend(None)


def qa_program(dsl: ModuleType) -> Any:
    """One program, written once, for SGLang's DSL and lmnb's."""

    @dsl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += dsl.gen("answer", max_tokens=6, temperature=0)
        s += "\nNumber:" + dsl.gen("number", max_tokens=4, regex=r" [0-9]{1,3}", temperature=0)

    return qa


def test_gen_regex_stream_and_run_batch_match_lmnb(endpoint, sgl_runtime) -> None:
    questions = ["What is 2 + 3?", "Name a colour.", "Why is the sky blue?"]
    remote, local = qa_program(sgl), qa_program(lmnb)
    state = remote.run(question=questions[0])
    expected = local.run(question=questions[0], backend=sgl_runtime)
    assert state["answer"] == expected["answer"] and state["number"] == expected["number"]
    assert re.fullmatch(r" [0-9]{1,3}", state["number"])
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"

    streamed = remote.run(question=questions[0], stream=True)
    pieces = list(streamed.text_iter("answer"))
    assert "".join(pieces) == expected["answer"]

    batch = remote.run_batch([{"question": q} for q in questions], num_threads=3)
    expected = [local.run(question=q, backend=sgl_runtime) for q in questions]
    assert [s["answer"] for s in batch] == [e["answer"] for e in expected]
    assert [s["number"] for s in batch] == [e["number"] for e in expected]


def test_select_and_fork(endpoint, sgl_runtime) -> None:
    @sgl.function
    def tips(s, topic):
        s += "Tips about " + topic + ". Tool:"
        s += sgl.select("tool", choices=[" calculator", " search engine", " none"])
        s += "\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:"
            f += sgl.gen("tip", max_tokens=4, temperature=0, stop="\n")
        for i in range(2):
            s += f"Tip {i + 1}:" + forks[i]["tip"] + "\n"

    state = tips.run(topic="cooking")
    assert state["tool"] in (" calculator", " search engine", " none")
    assert len(state.get_meta_info("tool")["normalized_prompt_logprobs"]) == 3
    prefix = f"Tips about cooking. Tool:{state['tool']}\n"
    for i in range(2):
        prompt = prefix + f"Tip {i + 1}:"
        out = sgl_runtime.generate(prompt, {"max_new_tokens": 4, "temperature": 0,
                                            "stop": "\n"})
        assert state.text().count(f"Tip {i + 1}:{out['text']}\n") == 1


def test_select_scores_as_against_sglangs_server(endpoint, sgl_runtime) -> None:
    """SGLang's `select` asks the prompt logprobs from two tokens before the prompt's end and
    averages the values that are not None; SGLang's server has None at the first position
    returned, so each choice scores the mean over the positions after it."""
    prompt, choices = "Tips about cooking. Tool:", [" calculator", " search engine", " none"]

    @sgl.function
    def tool(s):
        s += prompt
        s += sgl.select("tool", choices=choices)

    meta = tool.run().get_meta_info("tool")
    start = len(sgl_runtime.encode(prompt)) - 2
    for choice, score, rows in zip(choices, meta["normalized_prompt_logprobs"],
                                   meta["input_token_logprobs"], strict=True):
        out = sgl_runtime.generate(prompt + choice, {"max_new_tokens": 0}, return_logprob=True,
                                   logprob_start_len=start + 1)
        scored = [lp for lp, _ in out["meta_info"]["input_token_logprobs"]]
        assert rows[0][0] is None and len(rows) == len(scored) + 1
        assert score == pytest.approx(sum(scored) / len(scored), abs=1e-5)


def test_next_token_top_logprobs_with_max_tokens_zero(endpoint, sgl_runtime) -> None:
    """CoT decoding's first step (SGLang's example): max_tokens=0 gives the next token's top k."""

    @sgl.function
    def step_0(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=3,
                     return_text_in_logprobs=True)

    state = step_0.run(question="What is 2 + 3?")
    assert state["get_top_k"] == ""
    (top,) = state.get_meta_info("get_top_k")["output_top_logprobs"]
    prompt = "Question: What is 2 + 3?\nAnswer:"
    greedy = sgl_runtime.generate(prompt, {"max_new_tokens": 1, "temperature": 0},
                                  return_logprob=True, top_logprobs_num=3)
    (expected,) = greedy["meta_info"]["output_top_logprobs"]
    assert [token_id for _, token_id, _ in top] == [token_id for _, token_id in expected]
    assert [logprob for logprob, _, _ in top] == pytest.approx([lp for lp, _ in expected])
    tokenizer = sgl_runtime.tokenizer
    assert [text for _, _, text in top] == [tokenizer.decode([i]) for _, i, _ in top]
    assert greedy["output_ids"][0] == top[0][1]


def test_server_info_and_model_info_at_sglangs_paths(endpoint, sgl_runtime) -> None:
    """SGLang 0.5's frontend reads `/server_info` (`sgl.get_server_info()`); `/model_info` is
    the newer name of `/get_model_info`. Both old and new paths answer alike."""
    import httpx

    info = sgl.get_server_info()
    assert info["max_total_num_tokens"] == sgl_runtime.max_total_tokens
    assert info["context_length"] == sgl_runtime.context_len
    assert isinstance(info["internal_states"][0], dict)
    model_info = httpx.get(endpoint.base_url + "/model_info", timeout=60).json()
    assert model_info == endpoint.model_info
    assert model_info["model_path"] == str(sgl_runtime.model_dir)


def test_select_after_an_image_scores_each_choice_with_it(tiny_llavas, tmp_path) -> None:
    """SGLang's frontend scores a select's choices in one request of several prompts whose
    `image_data` is the state's one image, not a list: SGLang gives it to every prompt."""
    from PIL import Image

    from lmnb.server import ServerHandle

    pic = tmp_path / "pic.png"
    Image.new("RGB", (30, 20), (200, 30, 30)).save(pic)
    choices = [" red", " dark blue"]

    @sgl.function
    def colour(s):
        s += "Look: " + sgl.image(str(pic)) + " It is"
        s += sgl.select("colour", choices=choices)

    with lmnb.Runtime(tiny_llavas["llava-1.5"], max_total_tokens=8192) as runtime, \
            ServerHandle.start(runtime) as server:
        state = colour.run(backend=sgl.RuntimeEndpoint(server.url))
        assert state.error() is None
        rows = state.get_meta_info("colour")["input_token_logprobs"]
        for choice, row in zip(choices, rows, strict=True):
            out = runtime.generate("Look: <image> It is" + choice, {"max_new_tokens": 0},
                                   image_data=pic.read_bytes(), return_logprob=True,
                                   logprob_start_len=0)
            expected = out["meta_info"]["input_token_logprobs"][-len(row):]
            assert [token for _, token, _ in row] == [token for _, token in expected]
            assert row[0][0] is None  # SGLang's first position returned has no logprob
            assert [lp for lp, _, _ in row[1:]] == pytest.approx(
                [lp for lp, _ in expected[1:]], abs=1e-4)


def test_logprob_meta_info_has_sglangs_keys_without_a_start(endpoint, sgl_runtime) -> None:
    """With `return_logprob` SGLang's meta_info always has the prompt's logprob lists (empty
    without `logprob_start_len`), beside the output's; streamed or not."""

    @sgl.function
    def scored(s):
        s += "The sky is"
        s += sgl.gen("a", max_tokens=2, temperature=0, return_logprob=True, top_logprobs_num=2)

    for stream in (False, True):
        state = scored.run(stream=stream)
        assert len("".join(state.text_iter("a"))) > 0
        meta = state.get_meta_info("a")
        assert (meta["input_token_logprobs"], meta["input_top_logprobs"]) == ([], []), stream
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2
    out = sgl_runtime.generate("The sky is", {"max_new_tokens": 1}, return_logprob=True,
                               token_ids_logprob=[5, 6])
    assert out["meta_info"]["input_token_ids_logprobs"] == []


def test_json_schema_choices_and_stop_match_lmnb(endpoint, sgl_runtime) -> None:
    """`gen(json_schema=...)`, `gen(choices=...)` (SGLang's select) and `gen(stop=[...])` give,
    through SGLang's frontend, what lmnb's DSL gets in process. (The choices' scores differ by
    design: SGLang's frontend also averages the prompt's last token, lmnb's only the choice's:
    `lmnb/lang/choices.py`.)"""
    import json

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string",
                         "maxLength": 6}}, "required": ["name"]})

    def program(dsl: ModuleType) -> Any:
        @dsl.function
        def person(s):
            s += "Person:" + dsl.gen("p", max_tokens=40, temperature=0, json_schema=schema)
            s += "\nColour:" + dsl.gen("c", choices=[" red", " dark blue", " green"])
            s += "\nCount: 1, 2," + dsl.gen("n", max_tokens=12, temperature=0, stop=[",", "."])

        return person

    remote = program(sgl).run()
    local = program(lmnb).run(backend=sgl_runtime)
    assert remote.error() is None
    assert set(json.loads(remote["p"])) == {"name"}
    for name in ("p", "c", "n"):
        assert remote[name] == local[name], name
    assert remote.text() == local.text()
    for key in ("completion_tokens", "finish_reason"):
        assert remote.get_meta_info("n")[key] == local.get_meta_info("n")[key]


def test_gen_logprobs_from_a_start_as_the_runtimes(endpoint, sgl_runtime) -> None:
    """`gen(return_logprob=True, logprob_start_len=k, top_logprobs_num=2,
    return_text_in_logprobs=True)`: the prompt's logprobs from token k and the output's, with
    their texts, as the runtime gives them for the same request."""
    prompt = "The sky is blue and"

    @sgl.function
    def scored(s):
        s += prompt
        s += sgl.gen("a", max_tokens=3, temperature=0, return_logprob=True,
                     logprob_start_len=2, top_logprobs_num=2, return_text_in_logprobs=True)

    meta = scored.run().get_meta_info("a")
    out = sgl_runtime.generate(prompt, {"max_new_tokens": 3, "temperature": 0},
                               return_logprob=True, logprob_start_len=2, top_logprobs_num=2,
                               return_text_in_logprobs=True)
    expected = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(sgl_runtime.encode(prompt)) - 2
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [row[1:] for row in meta[key]] == [list(row[1:]) for row in expected[key]]
    # SGLang's server: None at the first prompt position returned (the runtime scores it)
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert [row[0] for row in meta["input_token_logprobs"][1:]] == pytest.approx(
        [row[0] for row in expected["input_token_logprobs"][1:]], abs=1e-5)
    assert [row[0] for row in meta["output_token_logprobs"]] == pytest.approx(
        [row[0] for row in expected["output_token_logprobs"]], abs=1e-5)
    for rows, expected_rows in zip(meta["output_top_logprobs"], expected["output_top_logprobs"],
                                   strict=True):
        assert [row[1:] for row in rows] == [list(row[1:]) for row in expected_rows]


def test_async_stream_and_run_batch_with_a_progress_bar(endpoint, sgl_runtime, capfd) -> None:
    """`state.text_async_iter(name)` of a streamed run, and `run_batch(num_threads=2,
    progress_bar=True)` (SGLang's tqdm bar counts every program)."""
    import asyncio

    remote, local = qa_program(sgl), qa_program(lmnb)
    expected = local.run(question="Name a colour.", backend=sgl_runtime)

    async def pieces() -> list[str]:
        state = remote.run(question="Name a colour.", stream=True)
        return [piece async for piece in state.text_async_iter("answer")]

    assert "".join(asyncio.run(pieces())) == expected["answer"]
    capfd.readouterr()
    questions = ["What is 2 + 3?", "Name a colour.", "Why is the sky blue?", "Say hi."]
    batch = remote.run_batch([{"question": q} for q in questions], num_threads=2,
                             progress_bar=True)
    assert [s["answer"] for s in batch] == [
        local.run(question=q, backend=sgl_runtime)["answer"] for q in questions]
    assert "4/4" in capfd.readouterr().err


def test_cache_prefix_and_flush_cache(endpoint, sgl_runtime) -> None:
    """`endpoint.cache_prefix(text)` leaves the text's tokens in the server's prefix cache, so a
    gen after it reports them as `cached_tokens`; `sgl.flush_cache()` empties the cache."""
    prefix = "You are a helpful assistant. Answer in one word.\n"

    @sgl.function
    def ask(s):
        s += prefix + "Q: Colour of the sky?\nA:" + sgl.gen("a", max_tokens=2, temperature=0)

    sgl.flush_cache()
    assert ask.run().get_meta_info("a")["cached_tokens"] == 0
    sgl.flush_cache()
    endpoint.cache_prefix(prefix)
    assert ask.run().get_meta_info("a")["cached_tokens"] == len(sgl_runtime.encode(prefix))
    sgl.flush_cache()
    assert ask.run().get_meta_info("a")["cached_tokens"] == 0


def test_roles_with_a_named_chat_template_match_lmnb(endpoint, sgl_runtime) -> None:
    """SGLang's frontend renders roles with its own template (named, or guessed from the
    model path); with "chatml", SmolLM2's own format, the text and the answer equal lmnb's
    (which renders the model's template); the assistant's gen stops at the turn's end."""

    def program(dsl: ModuleType) -> Any:
        @dsl.function
        def chat(s, question):
            s += dsl.system("You are brief.")
            s += dsl.user(question)
            s += dsl.assistant(dsl.gen("answer", max_tokens=6, temperature=0))
            s += dsl.user("And why?")
            s += dsl.assistant(dsl.gen("why", max_tokens=6, temperature=0))

        return chat

    backend = sgl.RuntimeEndpoint(endpoint.base_url, chat_template_name="chatml")
    remote = program(sgl).run(question="Name a colour.", backend=backend)
    local = program(lmnb).run(question="Name a colour.", backend=sgl_runtime)
    assert remote.error() is None
    assert (remote["answer"], remote["why"]) == (local["answer"], local["why"])
    assert remote.text() == local.text()
    assert remote.messages() == local.messages()


def test_gen_after_an_image_matches_lmnb(tiny_llavas, tmp_path) -> None:
    """`sgl.image` then gens, plain and streamed, through SGLang's frontend on a LLaVA model:
    every request carries the image, and the text equals lmnb's DSL in process."""
    from PIL import Image

    from lmnb.server import ServerHandle

    pic = tmp_path / "pic.png"
    Image.new("RGB", (30, 20), (200, 30, 30)).save(pic)

    def program(dsl: ModuleType) -> Any:
        @dsl.function
        def describe(s):
            s += "Look: " + dsl.image(str(pic)) + " It is"
            s += dsl.gen("a", max_tokens=5, temperature=0)
            s += " and" + dsl.gen("b", max_tokens=3, temperature=0)

        return describe

    with lmnb.Runtime(tiny_llavas["llava-1.5"], max_total_tokens=8192) as runtime, \
            ServerHandle.start(runtime) as server:
        backend = sgl.RuntimeEndpoint(server.url)
        local = program(lmnb).run(backend=runtime)
        remote = program(sgl).run(backend=backend)
        assert remote.error() is None
        assert (remote["a"], remote["b"]) == (local["a"], local["b"])
        assert remote.text() == local.text()
        streamed = program(sgl).run(backend=backend, stream=True)
        assert "".join(streamed.text_iter("a")) == local["a"]
        assert streamed.text() == local.text()
        alone = runtime.generate("Look: <image> It is", {"max_new_tokens": 5, "temperature": 0},
                                 image_data=pic.read_bytes())
        assert alone["text"] == local["a"]


def test_penalties_min_tokens_and_stop_regex_match_lmnb(endpoint, sgl_runtime) -> None:
    """The rest of `sgl.gen`'s sampling arguments, which SGLang's frontend sends in
    `sampling_params` (frequency/presence penalties, min_tokens with ignore_eos, stop_token_ids,
    stop_regex, top_k/top_p/min_p): the same text and finish reason as lmnb's DSL. The text
    ends before a stop_regex's match, as `Runtime.generate`'s (lmnb's rule; SGLang 0.5 leaves
    the match in): an unstreamed `/generate` kept what its internal stream had delivered."""

    def program(dsl: ModuleType) -> Any:
        @dsl.function
        def words(s):
            s += "Words:" + dsl.gen("a", max_tokens=12, temperature=0, frequency_penalty=1.5,
                                    presence_penalty=1.0)
            s += "\nMore:" + dsl.gen("b", max_tokens=10, temperature=0, min_tokens=6,
                                     ignore_eos=True, stop_token_ids=[2])
            s += "\nAgain:" + dsl.gen("c", max_tokens=10, temperature=0,
                                      stop_regex=r"(welcome ){2}")
            s += "\nLast:" + dsl.gen("d", max_tokens=8, temperature=0.7, top_k=1, top_p=0.5,
                                     min_p=0.2)

        return words

    remote = program(sgl).run()
    local = program(lmnb).run(backend=sgl_runtime)
    assert remote.error() is None
    for name in "abcd":
        assert remote[name] == local[name], name
        assert remote.get_meta_info(name)["finish_reason"] == \
            local.get_meta_info(name)["finish_reason"], name
    plain = sgl_runtime.generate("Words:", {"max_new_tokens": 12, "temperature": 0})
    assert plain["text"] != local["a"]  # the penalties changed the greedy text
    assert remote.get_meta_info("c")["finish_reason"]["type"] == "stop"


def test_join_concate_and_append_matches_lmnb(endpoint, sgl_runtime) -> None:
    """`forks.join("concate_and_append")`: SGLang's frontend asks the server to append the
    forks' KV to the parent (`/concate_and_append_request`, which SGLang 0.5's server lacks),
    then continues from the joined text: the program's text equals lmnb's DSL."""

    def program(dsl: ModuleType) -> Any:
        @dsl.function
        def tips(s):
            s += "Tips:"
            forks = s.fork(2)
            for i in range(2):
                forks[i] += f" {i + 1}." + dsl.gen("tip", max_tokens=3, temperature=0)
            forks.join("concate_and_append")
            s += "\nSo" + dsl.gen("end", max_tokens=3, temperature=0)

        return tips

    import httpx

    # first on its own: without the route, SGLang's frontend waits forever on the failed join
    answer = httpx.post(endpoint.base_url + "/concate_and_append_request",
                        json={"src_rids": ["1", "2"], "dst_rid": "0"}, timeout=60)
    assert answer.status_code == 200
    remote = program(sgl).run()
    local = program(lmnb).run(backend=sgl_runtime)
    assert remote.error() is None
    assert remote.text() == local.text()
    assert remote["end"] == local["end"]
