"""SGLang frontend programs run unchanged through `import lmnb as sgl`: the programs here are
written in SGLang's style (its names, positional forms and defaults) for this test, and run on a
tiny random-weight Llama, over the in-process runtime and over the server (`RuntimeEndpoint`)."""

from __future__ import annotations

import re

import pytest

import lmnb as sgl
from lmnb.lang import default_backend as default_backend_module
from lmnb.lang import program as program_module
from lmnb.lang.backends.base import Backend
from tests.fake_backend import TextOnlyFake


@sgl.function
def answer(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=6, temperature=0)


# ---- names ---------------------------------------------------------------------------------------
def test_backend_calls_on_a_backend_without_them():
    """`sgl.flush_cache()` / `sgl.get_server_info()` on a backend lacking the call say so."""
    with pytest.raises(NotImplementedError, match="TextOnlyFake has no flush_cache"):
        sgl.flush_cache(TextOnlyFake())
    with pytest.raises(NotImplementedError, match="TextOnlyFake has no get_server_info"):
        sgl.get_server_info(TextOnlyFake())


def test_module_level_names(sgl_backend):
    assert sgl.Engine is sgl.Runtime
    assert isinstance(sgl_backend, sgl.Engine)
    state = answer.run(question="What is 1+1?")
    assert state["answer"]
    assert sgl.flush_cache() is True
    info = sgl.get_server_info()
    assert info["max_total_num_tokens"] == sgl_backend.max_total_tokens
    assert isinstance(info["internal_states"][0], dict)
    assert sgl.global_config.default_backend is program_module.default_backend()
    assert sgl.global_config.enable_precache_with_tracing is True
    assert {"verbosity", "skip_special_tokens_in_output"} <= set(vars(sgl.global_config))


def test_regex_constants_are_sglangs():
    from lmnb.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    assert re.fullmatch(REGEX_INT, "-42 ") and not re.fullmatch(REGEX_INT, "4.2")
    assert re.fullmatch(REGEX_FLOAT, "3.25\n")
    assert re.fullmatch(REGEX_BOOL, "True") and not re.fullmatch(REGEX_BOOL, "true")
    assert re.fullmatch(REGEX_STR, '"hello world"')


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_choice_methods_as_objects(sgl_backend, method):
    @sgl.function
    def pick(s):
        s += "The sky is"
        s += sgl.select("colour", [" blue", " green", " red"], choices_method=method)

    state = pick.run()
    assert state["colour"] in (" blue", " green", " red")
    assert state.get_meta_info("colour")["method"] == method
    from lmnb.lang.choices import RuntimeChoiceScorer

    assert method(RuntimeChoiceScorer(sgl_backend), "The sky is", [" blue", " green"]).choice \
        in (" blue", " green")


def test_runtime_endpoint_over_the_server(sgl_runtime, monkeypatch):
    from lmnb.server import ServerHandle

    monkeypatch.setattr(default_backend_module, "_default_backend", None)
    with ServerHandle.start(sgl_runtime) as server:
        endpoint: Backend = sgl.RuntimeEndpoint(server.url)
        assert isinstance(endpoint, Backend)
        sgl.set_default_backend(endpoint)
        remote = answer.run(question="What is 1+1?")
        local = answer.run(question="What is 1+1?", backend=sgl_runtime)
        assert remote["answer"] == local["answer"]
        assert remote.get_meta_info("answer")["completion_tokens"] == 6

        @sgl.function
        def pick(s):
            s += "The sky is"
            s += sgl.select("colour", [" blue", " green", " red"])

        assert pick.run()["colour"] == pick.run(backend=sgl_runtime)["colour"]
        assert sgl.get_server_info()["max_total_num_tokens"] == sgl_runtime.max_total_tokens
        assert sgl.flush_cache() is True


# ---- gen, select, meta info ----------------------------------------------------------------------
def test_logprobs_with_text_and_positional_select(sgl_backend):
    @sgl.function
    def scored(s):
        s += "The sky is"
        s += sgl.gen("plain", max_tokens=3, temperature=0, return_logprob=True)
        s += sgl.gen("texts", max_tokens=3, temperature=0, return_logprob=True,
                     top_logprobs_num=2, return_text_in_logprobs=True)
        s += sgl.select("pick", [" yes", " no"], 0.0, sgl.greedy_token_selection)

    state = scored.run()
    plain = state.get_meta_info("plain")["output_token_logprobs"]
    assert all(len(entry) == 2 for entry in plain)
    triples = state.get_meta_info("texts")["output_token_logprobs"]
    tokenizer = sgl_backend.get_tokenizer()
    assert [text for _, _, text in triples] == [tokenizer.decode([i]) for _, i, _ in triples]
    assert "".join(text for _, _, text in triples) == state["texts"]
    assert all(len(entry) == 3 for row in state.get_meta_info("texts")["output_top_logprobs"]
               for entry in row)
    assert state.get_meta_info("pick")["method"] == "greedy_token_selection"
    assert state.get_meta_info("no_such_variable") is None


# ---- dtype ---------------------------------------------------------------------------------------
class Recorder(TextOnlyFake):
    """A backend without a model: records each gen's parameters and replies `reply`."""

    def __init__(self, reply: str = "7") -> None:
        super().__init__()
        self.reply = reply
        self.params: list = []

    def generate(self, prompt, params, *, on_delta=None, cancel=None):
        from lmnb.lang.backends.base import Generation

        self.params.append(params)
        return Generation(self.reply, {"finish_reason": {"type": "stop"}})

    def select(self, prompt, choices, method):
        return choices[0], {"method": method}


def test_dtype_regexes_and_stops_as_sglang(sgl_runtime):
    from lmnb.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    @sgl.function
    def typed(s):
        s += "n=" + sgl.gen("n", dtype=int) + " x=" + sgl.gen("x", dtype="float", stop="!")
        s += " ok=" + sgl.gen("ok", dtype=bool) + " s=" + sgl.gen_string("s")

    recorder = Recorder()
    typed.run(backend=recorder).sync()
    assert [p.regex for p in recorder.params] == [REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR]
    assert [p.stop for p in recorder.params] == [(" ", "\n"), ("!", " ", "\n"), None, None]
    with pytest.warns(UserWarning, match="dtype"):
        assert sgl.gen("n", dtype=int, regex="[0-9]").params.regex == REGEX_INT

    # On the model: an int ends before any whitespace; a bool is True or False.
    state = typed.run(backend=sgl_runtime, temperature=1.0, max_new_tokens=8, seed=1)
    meta = state.get_meta_info("n")
    assert re.fullmatch(r"[-+]?[0-9]+", state["n"]) or meta["finish_reason"]["type"] == "length"
    assert state["ok"] in ("True", "False")


# ---- ProgramState --------------------------------------------------------------------------------
def test_state_item_assignment_iterators_and_copy(sgl_backend):
    @sgl.function
    def chat(s, topic):
        s["topic"] = topic
        s += "Topic: " + topic + "\n"
        with s.copy() as draft:
            draft += "Draft:" + sgl.gen("draft", max_tokens=4, temperature=0)
        s["first_draft"] = draft["draft"]
        s += "Final:" + sgl.gen("final", max_tokens=4, temperature=0)

    state = chat.run(topic="tea")
    assert repr(state) == f"ProgramState({state.text()})"
    assert state["topic"] == "tea" and state.get_var("topic") == "tea"
    assert state["draft"] == [state["first_draft"]]  # joined back at the block's end
    assert not state.text().count("Draft:")  # the copy's text stays in the copy

    streamed = chat.run(topic="tea", stream=True)
    assert "".join(streamed.text_iter(var_name="final")) == state["final"]

    async def collect() -> str:
        return "".join([chunk async for chunk in streamed.text_async_iter(var_name="final")])

    import asyncio

    assert asyncio.run(collect()) == state["final"]
    assert "".join(chat.run(topic="tea", stream=True).text_iter()) == state.text()


@sgl.function
def tale(s):
    s += "Once upon a time" + sgl.gen("tale", max_tokens=64, temperature=0, ignore_eos=True)


def check_meta_pairs(pairs: list, streamed, expected: str) -> None:
    """`text_iter("tale", return_meta_data=True)`'s pairs of the `streamed` run: the chunks
    make the text, each meta info is the gen's so far, the last one is the final. (How many
    pairs depends on when the reader attaches: test_dsl's gated backend pins the streaming.)"""
    chunks, metas = [chunk for chunk, _ in pairs], [meta for _, meta in pairs]
    final = streamed.get_meta_info("tale")
    assert "".join(chunks) == streamed["tale"] == expected
    assert metas[-1] == final
    assert final["completion_tokens"] == 64 and final["finish_reason"]["type"] == "length"
    assert all(meta["finish_reason"] is None for meta in metas[:-1])
    assert all(meta["prompt_tokens"] == final["prompt_tokens"] for meta in metas)
    counts = [meta["completion_tokens"] for meta in metas]
    assert counts[0] >= 1 and counts == sorted(counts)


def check_meta_pairs_both_ways(backend, expected: str) -> None:
    """The pairs of `text_iter` and of `text_async_iter`, each of a streamed run."""
    import asyncio

    async def collect() -> tuple[list, object]:
        streamed = tale.run(backend=backend, stream=True)
        return [p async for p in streamed.text_async_iter("tale", return_meta_data=True)], \
            streamed

    streamed = tale.run(backend=backend, stream=True)
    check_meta_pairs(list(streamed.text_iter("tale", return_meta_data=True)), streamed,
                     expected)
    check_meta_pairs(*asyncio.run(collect()), expected)


def test_text_iter_with_meta_data_on_the_runtime(sgl_backend):
    """SGLang's `text_async_iter(name, return_meta_data=True)`: `(chunk, meta_info)` pairs, the
    meta info the gen's so far (lmnb's `text_iter` takes it too)."""
    check_meta_pairs_both_ways(sgl_backend, tale.run()["tale"])
    with pytest.raises(ValueError, match="variable name"):
        tale.run(stream=True).text_iter(return_meta_data=True)


def test_text_iter_with_meta_data_over_the_server(sgl_runtime):
    from lmnb.server import ServerHandle

    with ServerHandle.start(sgl_runtime) as server:
        check_meta_pairs_both_ways(sgl.RuntimeEndpoint(server.url),
                                   tale.run(backend=sgl_runtime)["tale"])


def test_an_exception_in_the_body_surfaces_from_run(sgl_backend):
    @sgl.function
    def failing(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        raise ZeroDivisionError("in the body")

    with pytest.raises(ZeroDivisionError, match="in the body"):
        failing.run()


# ---- fork / join, run_batch ----------------------------------------------------------------------
def test_fork_position_ids_offset_is_refused_by_name(sgl_backend):
    """SGLang's `s.fork(size, position_ids_offset)`: lmnb's runtime offsets no positions, so
    lmnb's backends (and tracing) refuse an offset by name instead of ignoring it; None runs."""

    def forked(offsets):
        @sgl.function
        def tips(s):
            s += "Tips:"
            forks = s.fork(2, position_ids_offset=offsets)
            forks += sgl.gen("tip", max_tokens=2, temperature=0)
            forks.join()
            with s.copy(position_ids_offset=None) as draft:
                draft += sgl.gen("draft", max_tokens=2, temperature=0)

        return tips

    state = forked(None).run()
    assert len(state["tip"]) == 2 and len(state["draft"]) == 1
    with pytest.raises(NotImplementedError, match=r"fork\(position_ids_offset=...\) is not "
                                                  r"supported on LocalBackend"):
        forked([0, 4]).run()
    with pytest.raises(NotImplementedError, match=r"position_ids_offset=...\) cannot be traced"):
        forked([0, 4]).trace()
    with pytest.raises(ValueError, match=r"one int per branch \(2\), got \[0\]"):
        forked([0]).run()


def test_fork_join_as_sglang(sgl_backend):
    @sgl.function
    def tips(s):
        s += "Tips:" + sgl.gen("intro", max_tokens=2, temperature=0)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\n{i + 1}." + sgl.gen("tip", max_tokens=3, temperature=0)
            f += sgl.gen("intro", max_tokens=1, temperature=0)  # the parent's: kept there
        forks.join()
        s += "\nMore:"
        again = s.fork(2)
        again += sgl.gen("more", max_tokens=2, temperature=0)
        again.join("concate_and_append")

    state = tips.run()
    assert isinstance(state["tip"], list) and len(state["tip"]) == 2
    assert isinstance(state["intro"], str)
    assert state.text().startswith("Tips:" + state["intro"] + "\nMore:")
    assert len(state.text()) > len("Tips:" + state["intro"] + "\nMore:")


def test_run_batch_with_positional_tuples(sgl_backend, capsys):
    @sgl.function
    def pair(s, a, b):
        s += a + " and " + b + sgl.gen("rest", max_tokens=2, temperature=0)

    states = pair.run_batch([("salt", "pepper"), ["oil", "vinegar"], {"a": "x", "b": "y"}])
    assert [s.text().split(" and ")[0] for s in states] == ["salt", "oil", "x"]
    assert states[1]["rest"] == pair.run("oil", "vinegar")["rest"]
    assert "pair" not in capsys.readouterr().err  # no progress bar unless asked
    compiled = pair.compile()
    assert [s["rest"] for s in compiled.run_batch([("salt", "pepper")])] == [states[0]["rest"]]


def test_copy_block_traces_and_compiles(sgl_backend):
    @sgl.function
    def drafts(s, topic):
        s += "Topic: " + topic + "\n"
        with s.copy() as draft:
            draft += "Draft:" + sgl.gen("draft", max_tokens=3, temperature=0)
        s += "Final:" + sgl.gen("final", max_tokens=3, temperature=0)

    expected = drafts.run(topic="tea")
    compiled = drafts.compile().run(topic="tea")
    assert compiled["draft"] == expected["draft"] and len(expected["draft"]) == 1
    assert compiled.text() == expected.text()


def test_trace_compile_and_cache_take_sglangs_arguments(sgl_backend):
    @sgl.function
    def shared(s, question):
        s += "You answer questions about tea.\n" * 4
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=2, temperature=0)

    traced = shared.trace(backend=sgl_backend)
    assert traced.last_node is not None and traced.last_node == traced.nodes()[-1]
    prefix = shared.cache()
    assert prefix.startswith("You answer questions about tea.")
    hits = sgl_backend.stats()["cached_tokens"]
    state = shared.compile(backend=sgl_backend).run(question="Green?")
    assert state.get_meta_info("answer")["cached_tokens"] > 0
    assert sgl_backend.stats()["cached_tokens"] > hits


# ---- next-token top logprobs, token texts --------------------------------------------------------
def test_max_tokens_zero_gives_the_next_tokens_top_logprobs(sgl_backend):
    """SGLang's `gen(max_tokens=0, return_logprob=True, top_logprobs_num=k)` (CoT decoding's
    first step): one row, the top k of the token that would come next; nothing is generated."""
    prompt = "The sky is"
    greedy = sgl_backend.generate(prompt, {"max_new_tokens": 1, "temperature": 0},
                                  return_logprob=True, top_logprobs_num=3)
    (expected,) = greedy["meta_info"]["output_top_logprobs"]
    assert expected[0][1] == greedy["output_ids"][0]

    out = sgl_backend.generate(prompt, {"max_new_tokens": 0}, return_logprob=True,
                               top_logprobs_num=3, return_text_in_logprobs=True)
    assert (out["text"], out["output_ids"], out["meta_info"]["completion_tokens"]) == ("", [], 0)
    (row,) = out["meta_info"]["output_top_logprobs"]
    tokenizer = sgl_backend.get_tokenizer()
    assert [(i, text) for _, i, text in row] == [(i, tokenizer.decode([i])) for _, i in expected]
    assert [lp for lp, _, _ in row] == pytest.approx([lp for lp, _ in expected])
    plain = sgl_backend.generate(prompt, {"max_new_tokens": 0}, return_logprob=True)
    assert "output_top_logprobs" not in plain["meta_info"]  # no top k asked: nothing sampled

    @sgl.function
    def cot_decoding(s):  # the shape of SGLang's CoT-decoding example
        s += prompt
        step_0 = s.fork(1)[0]
        forks = s.fork(2)
        step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=2,
                          return_text_in_logprobs=True)
        top = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
        for f, (_, _, text) in zip(forks, top, strict=True):
            f += text + sgl.gen("answer", max_tokens=2, temperature=0)
        return top, [f.text() for f in forks]

    state = cot_decoding.run()
    top, texts = state.ret_value
    assert [(i, text) for _, i, text in top] == [(i, text) for _, i, text in row[:2]]
    assert [t[:len(prompt + text)] for t, (_, _, text) in zip(texts, top, strict=True)] == [
        prompt + text for _, _, text in top]
    assert state.text() == prompt
    sgl_backend.check_integrity()


def test_runtime_generate_returns_token_texts(sgl_backend):
    out = sgl_backend.generate(["The sky is", "Grass is"], {"max_new_tokens": 3, "temperature": 0},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                               return_text_in_logprobs=True)
    tokenizer = sgl_backend.get_tokenizer()
    for result in out:
        meta = result["meta_info"]
        triples = meta["output_token_logprobs"]
        assert [i for _, i, _ in triples] == result["output_ids"]
        assert "".join(text for _, _, text in triples) == result["text"]
        assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has none
        assert [t for _, _, t in meta["input_token_logprobs"]] == [
            tokenizer.decode([i]) for _, i, _ in meta["input_token_logprobs"]]
        assert all(len(entry) == 3 for row in meta["output_top_logprobs"] for entry in row)
    pairs = sgl_backend.generate("The sky is", {"max_new_tokens": 3, "temperature": 0},
                                 return_logprob=True)
    assert all(len(entry) == 2 for entry in pairs["meta_info"]["output_token_logprobs"])


def test_generate_route_takes_sglangs_sampling_params(sgl_runtime):
    """Every name of SGLang 0.5's `SamplingParams` reaches the runtime: implemented ones work,
    the others pass with their default and are refused by name (HTTP 400) otherwise."""
    import httpx

    from lmnb.server import ServerHandle

    frontend_defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                         "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
                         "custom_params": None, "beam_width": None, "structural_tag": None,
                         "watermark": None, "stop": [], "stop_token_ids": [], "stop_regex": [],
                         "regex": None, "json_schema": None, "temperature": None}
    with ServerHandle.start(sgl_runtime) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        seeded = http.post("/generate", json={"text": "The sky is", "sampling_params": {
            **frontend_defaults, "max_new_tokens": 4, "sampling_seed": 5}}).json()
        again = sgl_runtime.generate("The sky is", {"max_new_tokens": 4, "seed": 5})
        assert seeded["text"] == again["text"]
        for name, value in (("no_stop_trim", True), ("spaces_between_special_tokens", False),
                            ("beam_width", 4)):
            response = http.post("/generate", json={"text": "x", "sampling_params": {
                "max_new_tokens": 2, name: value}})
            assert response.status_code == 400, name
            assert f"unsupported sampling param {name}=" in response.text
        top = http.post("/generate", json={
            "text": "The sky is", "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()
        (row,) = top["meta_info"]["output_top_logprobs"]
        tokenizer = sgl_runtime.get_tokenizer()
        assert [text for _, _, text in row] == [tokenizer.decode([i]) for _, i, _ in row]
        assert top["text"] == "" and top["meta_info"]["output_token_logprobs"] == []
    sgl_runtime.check_integrity()


# ---- a custom backend in SGLang's shape ----------------------------------------------------------
def test_a_custom_backend_subclassing_base_backend():
    import gc
    import threading
    import time

    from lmnb.lang.backends.base import BaseBackend, ChoicesDecision

    class Counting(BaseBackend):
        """Answers with facts about its prompt; records the hooks called."""

        def __init__(self):
            super().__init__()
            self.calls = []
            self.next_piece = threading.Semaphore(0)  # the test lets each streamed piece after

        def get_model_name(self):
            return "counting"

        def begin_program(self, s):
            self.calls.append(("begin", s))

        def end_program(self, s):
            self.calls.append(("end", s))

        def fork_program(self, src, dst, position_ids_offset=None):
            self.calls.append(("fork", len(dst), src.text_))
            if position_ids_offset is not None:
                self.calls.append(("offsets", position_ids_offset))

        def commit_lazy_operations(self, s):
            self.calls.append(("commit", s.text_))

        def cache_prefix(self, prefix_str):
            self.calls.append(("cache", prefix_str))

        def generate(self, s, sampling_params):
            words = len(s.text_.split())
            self.calls.append(("generate", sampling_params.max_new_tokens,
                               sampling_params.stop, sampling_params.temperature))
            return f" {words} words", {"words": words, "finish_reason": {"type": "stop"}}

        def generate_stream(self, s, sampling_params):
            for i, piece in enumerate((" one", " two", " three")[:sampling_params.max_new_tokens]):
                if i:
                    assert self.next_piece.acquire(timeout=30)
                yield piece, {"piece": piece}

        def select(self, s, choices, temperature, choices_method=None):
            best = max(choices, key=lambda c: (len(c), c))
            return ChoicesDecision(best, {"method": str(choices_method), "prompt": s.text_})

    @sgl.function
    def program(s, topic):
        s += "Tell me about " + topic + "."
        s += sgl.gen("count", max_tokens=7, stop="\n", temperature=0.5)
        s += " Pick:" + sgl.select("pick", ["x", "yyy", "zz"],
                                   choices_method=sgl.greedy_token_selection)
        s += sgl.gen("default_pick", choices=["a", "bb"], choices_method=None)  # SGLang's default
        forks = s.fork(2)
        forks += sgl.gen("branch", max_tokens=2)
        forks.join()

    backend = Counting()
    state = program.run(topic="cats", backend=backend)
    assert state["count"] == " 4 words"
    assert state.get_meta_info("count")["words"] == 4
    assert state["pick"] == "yyy"
    assert state.get_meta_info("pick") == {"method": "greedy_token_selection",
                                           "prompt": "Tell me about cats. 4 words Pick:"}
    assert state.get_meta_info("default_pick")["method"] == "token_length_normalized"
    assert state["branch"] == [" 7 words", " 7 words"]
    assert state.text() == "Tell me about cats. 4 words Pick:yyybb"
    kinds = [call[0] for call in backend.calls]
    assert ("generate", 7, ["\n"], 0.5) in backend.calls
    assert ("commit", state.text()) in backend.calls and ("fork", 2, state.text()) in backend.calls
    assert kinds.count("begin") == 3  # the program's executor and its two branches

    @sgl.function
    def story(s):
        s += "Once" + sgl.gen("story", max_tokens=3)

    streamed = story.run(backend=backend, stream=True)
    pieces = streamed.text_iter("story")
    assert next(pieces) == " one"
    backend.next_piece.release()
    assert next(pieces) == " two"
    backend.next_piece.release()
    assert list(pieces) == [" three"]
    assert streamed["story"] == " one two three"
    assert streamed.get_meta_info("story") == {"piece": " three"}
    pairs = story.run(backend=backend, stream=True).text_iter("story", return_meta_data=True)
    assert next(pairs) == (" one", {"piece": " one"})  # generate_stream's meta info
    backend.next_piece.release()
    assert next(pairs) == (" two", {"piece": " two"})
    backend.next_piece.release()
    assert list(pairs) == [(" three", {"piece": " three"})]

    @sgl.function
    def offset_forks(s):
        s += "Once"
        forks = s.fork(2, position_ids_offset=[3, 5])
        forks += sgl.gen("end", max_tokens=2)
        forks.join()

    assert offset_forks.run(backend=backend)["end"] == [" 1 words"] * 2
    assert ("offsets", [3, 5]) in backend.calls

    backend.calls.clear()
    states = program.run_batch([{"topic": "owls"}, {"topic": "bats"}], backend=backend)
    assert [s["count"] for s in states] == [" 4 words"] * 2
    assert backend.calls[0] == ("cache", "Tell me about ")

    executor = state.executor
    del state, states
    gc.collect()
    deadline = time.monotonic() + 30  # bounds a failing test only
    while ("end", executor) not in backend.calls:
        assert time.monotonic() < deadline, "end_program was not called"
        time.sleep(0.02)


# ---- SGLang's keyword names ----------------------------------------------------------------------
def test_run_takes_sglangs_n_and_use_thread(sgl_backend):
    """SGLang's `run(..., n=1, use_thread=False)` and `run_batch(..., n=1)` run unchanged (one
    state holds one sample: a run-wide n above 1 is refused, a gen's own n is the way); a
    program's own parameter named `n` still gets its value."""
    expected = answer.run(question="What is 1+1?")["answer"]
    state = answer.run(question="What is 1+1?", n=1, use_thread=False, stop=[],
                       stop_token_ids=[], stop_regex=[], return_logprob=None)
    assert state["answer"] == expected
    assert [s["answer"] for s in answer.run_batch([{"question": "What is 1+1?"}], n=1)] == \
        [expected]
    with pytest.raises(ValueError, match=r"run\(n=2\)"):
        answer.run(question="What is 1+1?", n=2)

    @sgl.function
    def repeat(s, n):
        s += "ab" * n

    assert repeat.run(n=3).text() == "ababab"


def test_roles_and_media_take_sglangs_keyword_names(sgl_backend):
    """`sgl.user(expr=...)`, `s.user(expr=...)`, `sgl.image(expr=...)` and
    `sgl.video(path=..., num_frames=...)`: SGLang's parameter names."""
    from tests.test_llava_dsl import FakeMediaBackend

    @sgl.function
    def chat(s):
        s += sgl.system(expr="Be brief.")
        s.user(expr="Hi")
        s += sgl.assistant(expr=sgl.gen("a", max_tokens=2, temperature=0))

    state = chat.run()
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[1]["content"] == "Hi"

    @sgl.function
    def look(s):
        s += sgl.user(sgl.image(expr="cat.png") + sgl.video(path="clip.mp4", num_frames=3))
        s += sgl.assistant(sgl.gen("a"))

    backend = FakeMediaBackend()
    look.run(backend=backend).sync()
    assert backend.prepared == [("image", "cat.png", None), ("video", "clip.mp4", 3)]
