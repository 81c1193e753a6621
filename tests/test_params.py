"""`lmnb.params`: the one definition of the sampling parameters (validation, names, defaults, help),
importable without torch, and the DSL's use of it (gen arguments, run defaults, LocalBackend)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import fields
from typing import Any

import pytest

import lmnb
from lmnb import gen
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.ir import GEN_PARAM_NAMES, GenParams
from lmnb.lang.program import RUN_DEFAULTS, SAMPLING_DEFAULT_KEYS
from lmnb.params import (
    ACCEPTED_SAMPLING_PARAM_NAMES,
    GEN_ARGUMENTS,
    LOGPROB_DEFAULTS,
    LOGPROB_PARAM_NAMES,
    PARAM_HELP,
    SAMPLING_PARAM_NAMES,
    InvalidRequestError,
    SamplingParams,
    default_sampling_params,
    merged_params,
    param_help,
)


def test_import_needs_no_torch() -> None:
    code = "import lmnb.params, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_runtime_core_re_exports_the_same_classes() -> None:
    from lmnb.runtime import core

    assert core.SamplingParams is SamplingParams
    assert core.InvalidRequestError is InvalidRequestError
    assert issubclass(InvalidRequestError, ValueError)


# ---- validation --------------------------------------------------------------------------------
BAD_PARAMS: dict[str, tuple[dict[str, Any], str]] = {
    "max-negative": ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0 or None, got -1"),
    "max-float": ({"max_new_tokens": 2.5}, "max_new_tokens must be an int, got 2.5"),
    "max-bool": ({"max_new_tokens": True}, "max_new_tokens must be an int, got True"),
    "top-k-float": ({"top_k": 2.0}, "top_k must be an int, got 2.0"),
    "temperature-str": ({"temperature": "0.7"}, "temperature must be a finite number, got '0.7'"),
    "temperature-inf": ({"temperature": float("inf")},
                        "temperature must be a finite number, got inf"),
    "ignore-eos-str": ({"ignore_eos": "false"}, "ignore_eos must be true or false, got 'false'"),
    "skip-special-int": ({"skip_special_tokens": 0},
                         "skip_special_tokens must be true or false, got 0"),
    "regex-type": ({"regex": 5}, "regex must be a string, got 5"),
    "json-schema-type": ({"json_schema": 5}, "json_schema must be a string or a dict, got 5"),
    "stop-not-a-list": ({"stop": 5}, "stop must be a list, got 5"),
    "stop-ids-bool": ({"stop_token_ids": [True]}, "stop_token_ids must be a list of ints"),
    "stop-regex-not-a-list": ({"stop_regex": 5}, "stop_regex must be a string or a list"),
    "min-over-max": ({"min_new_tokens": 5, "max_new_tokens": 4},
                     "min_new_tokens (5) > max_new_tokens (4)"),
    "temperature": ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    "top-p-zero": ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    "top-k": ({"top_k": -2}, "top_k must be -1 (all) or >= 1, got -2"),
    "min-p": ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    "frequency": ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0"),
    "presence": ({"presence_penalty": -3.0}, "presence_penalty must be in [-2, 2], got -3.0"),
    "repetition": ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2], got 0.0"),
    "n": ({"n": 0}, "n must be an int >= 1, got 0"),
    "stop": ({"stop": ["a", 3]}, "stop must be a string or list of strings"),
    "stop-ids": ({"stop_token_ids": ["x"]}, "stop_token_ids must be a list of ints"),
    "seed": ({"seed": "7"}, "seed must be an int, got '7'"),
    "seed-too-big": ({"seed": 2**64}, f"seed must be in [{-2**63}, {2**64 - 1}]"),
    "seed-too-small": ({"seed": -2**63 - 1}, "seed must be in ["),
    "seed-plus-n": ({"seed": 2**64 - 1, "n": 2}, f"seed must be in [{-2**63}, {2**64 - 2}]"),
    "stop-regex": ({"stop_regex": ["ok", "(unclosed"]}, "stop_regex '(unclosed' is not a regex"),
    "stop-regex-type": ({"stop_regex": [1]}, "stop_regex must be a string or a list of strings"),
}


@pytest.mark.parametrize("params, message", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_invalid_params_say_what_is_wrong(params: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match="^invalid sampling params: ") as info:
        SamplingParams.from_dict(params)
    assert message in str(info.value)


def test_from_dict_rejects_unknown_keys_and_lists_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 3, "stop_regexp": "x"})
    message = str(info.value)
    assert message.startswith("unknown sampling params ['max_tokens', 'stop_regexp']; known: ")
    assert all(name in message for name in SAMPLING_PARAM_NAMES)
    with pytest.raises(InvalidRequestError, match="sampling_params must be a dict, got list"):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


def test_from_dict_builds_and_passes_through() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    params = SamplingParams(temperature=0.0)
    assert SamplingParams.from_dict(params) is params
    built = SamplingParams.from_dict({"temperature": 0.0, "stop": "END", "stop_token_ids": 7,
                                      "top_k": 0})
    assert (built.stop, built.stop_token_ids, built.top_k) == (["END"], [7], -1)
    assert built.is_greedy and not built.has_penalties
    assert SamplingParams(top_k=1).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


@pytest.mark.parametrize("given, patterns", [
    (None, []),
    ("a+b", ["a+b"]),
    (["x", r"\d+"], ["x", r"\d+"]),
    (("x", ""), ["x"]),  # empty patterns would match everywhere: dropped, as empty stops are
    ([], []),
])
def test_stop_regex_is_normalised_to_a_list_of_patterns(given: Any, patterns: list[str]) -> None:
    assert SamplingParams(stop_regex=given).stop_regex == patterns
    assert SamplingParams.from_dict({"stop_regex": given}).stop_regex == patterns


# ---- SGLang's names ---------------------------------------------------------------------------
# The API fields of SGLang 0.5's `SamplingParams` (0.5.1 ... 0.5.23), but `ebnf`, which lmnb adds as
# a field of its own.
SGLANG_NAMES = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "beam_width", "json_schema", "regex", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "watermark"}
# What SGLang's frontend and its docs send by default, null included.
SGLANG_DEFAULTS = {
    "max_new_tokens": 128, "stop": [], "stop_token_ids": [], "stop_regex": [],
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "beam_width": None, "json_schema": None, "regex": None, "structural_tag": None,
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
    "custom_params": None, "watermark": None}


def test_every_sglang_name_is_accepted_with_its_default() -> None:
    assert SGLANG_NAMES <= set(ACCEPTED_SAMPLING_PARAM_NAMES)
    assert set(SGLANG_DEFAULTS) == SGLANG_NAMES
    assert SamplingParams.from_dict(SGLANG_DEFAULTS) == SamplingParams()
    # null means the default, as in SGLang, but for max_new_tokens: no limit (the scheduler
    # cuts it to the context's room)
    nulls = {name: None for name in SGLANG_NAMES}
    assert SamplingParams.from_dict(nulls) == SamplingParams(max_new_tokens=None)
    equivalents = {"beam_width": 1, "stream_interval": 1, "logit_bias": {}, "custom_params": {}}
    assert SamplingParams.from_dict(equivalents) == SamplingParams()


@pytest.mark.parametrize("name, value", [
    ("spaces_between_special_tokens", False), ("no_stop_trim", True), ("beam_width", 4),
    ("stream_interval", 8), ("custom_params", {"a": 1}),
    ("structural_tag", '{"type": "x"}'), ("watermark", {"key": 1}), ("no_stop_trim", 1),
])
def test_an_unsupported_sglang_param_is_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError,
                       match=f"^unsupported sampling param {name}=.*does not implement {name}"):
        SamplingParams.from_dict({"max_new_tokens": 3, name: value})


def test_logit_bias_takes_token_ids_as_ints_or_json_strings() -> None:
    params = SamplingParams.from_dict({"logit_bias": {"42": 5, 7: -100.0, "0": 0.5}})
    assert params.logit_bias == {42: 5.0, 7: -100.0, 0: 0.5}
    assert all(type(v) is float for v in params.logit_bias.values())
    assert params.to_dict()["logit_bias"] == params.logit_bias
    assert params.to_dict()["logit_bias"] is not params.logit_bias
    assert SamplingParams.from_dict({"logit_bias": {"3": 250.0}}).logit_bias == {3: 250.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("value, problem", [
    ([[1, 2.0]], "must be an object"),
    ({"1.0": 1}, "keys must be token ids"),
    ({" 1": 1}, "keys must be token ids"),
    ({"x": 1}, "keys must be token ids"),
    ({True: 1}, "keys must be token ids"),
    ({1: 1, "1": 2}, "names token 1 twice"),
    ({"1": "2"}, "values must be finite numbers"),
    ({"1": True}, "values must be finite numbers"),
    ({"1": float("nan")}, "values must be finite numbers"),
    ({"1": float("-inf")}, "values must be finite numbers"),
])
def test_a_bad_logit_bias_is_refused_naming_it(value: Any, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"logit_bias {problem}") as raised:
        SamplingParams.from_dict({"logit_bias": value})
    assert raised.value.param == "logit_bias"


def test_sampling_seed_is_seed() -> None:
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": None, "seed": 3}).seed == 3
    with pytest.raises(InvalidRequestError, match="sampling_seed .7. and seed .3. differ"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 3})
    with pytest.raises(InvalidRequestError, match="seed must be an int"):
        SamplingParams.from_dict({"sampling_seed": "7"})


# ---- names, defaults, help ---------------------------------------------------------------------
def test_names_defaults_and_help_cover_every_parameter() -> None:
    assert SAMPLING_PARAM_NAMES == tuple(f.name for f in fields(SamplingParams))
    assert "stop_regex" in SAMPLING_PARAM_NAMES
    defaults = default_sampling_params()
    assert tuple(defaults) == SAMPLING_PARAM_NAMES
    assert SamplingParams(**defaults) == SamplingParams()
    # SGLang's defaults
    assert {k: defaults[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                                     "repetition_penalty", "n", "skip_special_tokens")} == {
        "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "n": 1, "skip_special_tokens": True}
    assert dict(LOGPROB_DEFAULTS) == {"return_logprob": False, "logprob_start_len": -1,
                                      "top_logprobs_num": 0, "return_text_in_logprobs": False}
    assert set(PARAM_HELP) == set(SAMPLING_PARAM_NAMES) | set(LOGPROB_PARAM_NAMES)
    assert all(text and "\n" not in text for text in PARAM_HELP.values())
    assert param_help("top_k") == f"{PARAM_HELP['top_k']} (default -1)"


def test_defaults_are_fresh_each_time() -> None:
    first = default_sampling_params()
    first["stop"].append("X")
    first["temperature"] = 0.0
    assert default_sampling_params()["stop"] == [] and SamplingParams().stop == []
    assert default_sampling_params()["temperature"] == 1.0


# ---- the DSL uses the same vocabulary ----------------------------------------------------------
def test_gen_arguments_are_params_names_and_run_defaults_are_the_runtimes() -> None:
    assert set(GEN_PARAM_NAMES) <= set(SAMPLING_PARAM_NAMES) | set(LOGPROB_PARAM_NAMES)
    assert set(SAMPLING_DEFAULT_KEYS) <= set(GEN_PARAM_NAMES)
    assert "stop_regex" in SAMPLING_DEFAULT_KEYS
    defaults = default_sampling_params()
    for name, value in RUN_DEFAULTS.set_values().items():
        assert value == defaults[name], name
    assert RUN_DEFAULTS.temperature == 1.0 and RUN_DEFAULTS.max_new_tokens == 128


def test_gen_keeps_stops_as_tuples_so_its_node_is_hashable() -> None:
    node = gen("a", stop_regex=["x+", r"\d"], stop=["END", "\n"], stop_token_ids=[5])
    hash(node)
    params = node.params  # type: ignore[attr-defined]
    assert params.stop_regex == ("x+", r"\d")
    assert (params.stop, params.stop_token_ids) == (("END", "\n"), (5,))
    assert gen("a", stop_regex="x+").params.stop_regex == ("x+",)  # type: ignore[attr-defined]
    assert gen("a", stop_regex="").params.stop_regex is None  # type: ignore[attr-defined]
    assert GenParams(stop={"only"}).stop == ("only",)
    with pytest.raises(InvalidRequestError, match="stop_regex '\\[' is not a regex"):
        gen("a", stop_regex=["ok", "["])


class FakeRuntime:
    """`Runtime.generate(stream=True)` without a model: streams `pieces`, records the call."""

    tokenizer = None

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.calls: list[dict[str, Any]] = []
        self.closed = False

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        raise NotImplementedError("no chat template")

    def batched_submits(self) -> AbstractContextManager[None]:
        return nullcontext()

    def generate(self, prompt: str, sampling_params: dict[str, Any], **kwargs: Any
                 ) -> FakeStream:
        SamplingParams.from_dict(sampling_params)  # what the runtime accepts
        self.calls.append({"prompt": prompt, "sampling_params": sampling_params, **kwargs})
        last = len(self.pieces) - 1
        return FakeStream(self, [
            {"text": piece, "meta_info": {
                "finish_reason": {"type": "length", "length": len(self.pieces)} if i == last
                else None}}
            for i, piece in enumerate(self.pieces)])


class FakeStream:
    """The part of `OutputStream` a backend uses: `get` (None at the end) or `async for` (the
    program loop's), and `close`."""

    def __init__(self, runtime: FakeRuntime, chunks: list[dict[str, Any]]) -> None:
        self.runtime = runtime
        self.chunks = chunks

    def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        return self.chunks.pop(0) if self.chunks else None

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def close(self) -> None:
        self.runtime.closed = True


def test_local_backend_sends_every_sampling_parameter() -> None:
    values = {"max_new_tokens": 9, "min_new_tokens": 2, "n": 1, "stop": ("END",),
              "stop_token_ids": (4, 5), "stop_regex": ("z",), "temperature": 0.5, "top_p": 0.9,
              "top_k": 3, "min_p": 0.1, "frequency_penalty": 0.2, "presence_penalty": 0.3,
              "seed": 11, "ignore_eos": True, "return_logprob": True, "logprob_start_len": 1,
              "top_logprobs_num": 2, "return_text_in_logprobs": True, "regex": "[a-z]+",
              "json_schema": None, "ebnf": None}
    assert set(values) == set(GEN_PARAM_NAMES)  # a new gen argument needs a line here
    sampling = LocalBackend(FakeRuntime([])).sampling_params(GenParams(**values))
    expected = {**default_sampling_params(),
                **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()
                   if k in SAMPLING_PARAM_NAMES and v is not None}}
    assert sampling == expected
    assert SamplingParams.from_dict(sampling).to_dict() == sampling


def test_gen_arguments_table_covers_every_gen_param() -> None:
    assert set(GEN_ARGUMENTS.values()) == set(GEN_PARAM_NAMES)
    assert len(set(GEN_ARGUMENTS.values())) == len(GEN_ARGUMENTS)  # one keyword per parameter
    keywords = set(inspect.signature(gen).parameters) - {"name", "dtype", "choices",
                                                         "choices_method"}
    assert set(GEN_ARGUMENTS) == keywords
    assert gen("a", max_tokens=3, min_tokens=1).params == GenParams(  # type: ignore[attr-defined]
        max_new_tokens=3, min_new_tokens=1)
    with pytest.raises(TypeError, match="unknown arguments \\['max_new_tokens'\\]"):
        GenParams.from_arguments({"max_new_tokens": 3})


def test_merged_params_is_overrides_over_defaults_with_none_unset() -> None:
    defaults = {"temperature": 0.5, "top_k": 4, "stop": ("a",), "seed": None}
    overrides = {"temperature": None, "top_k": 2, "seed": 7, "max_new_tokens": 3}
    assert merged_params(defaults, overrides) == {"temperature": 0.5, "top_k": 2, "stop": ("a",),
                                                   "seed": 7, "max_new_tokens": 3}
    merged = SamplingParams.merged(defaults, overrides)
    assert merged == SamplingParams(temperature=0.5, top_k=2, stop=["a"], seed=7,
                                    max_new_tokens=3)
    assert SamplingParams.merged({}) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="top_p must be in \\(0, 1\\], got 3"):
        SamplingParams.merged({"top_p": 0.5}, {"top_p": 3})


def test_one_gens_parameters_reach_runtime_generate_as_the_merged_sampling_params() -> None:
    runtime = FakeRuntime(["ok"])

    @lmnb.function
    def one(s):
        s += "Q: " + gen("a", max_tokens=5, stop="X", seed=3, top_k=None,
                         return_logprob=True, top_logprobs_num=2)

    one.run(backend=LocalBackend(runtime), temperature=0.25, top_k=4, stop_regex="z+")
    (call,) = runtime.calls
    gen_values = {"max_new_tokens": 5, "stop": ["X"], "seed": 3}
    run_values = {"temperature": 0.25, "top_k": 4, "stop_regex": ["z+"]}
    assert call["sampling_params"] == SamplingParams.merged(run_values, gen_values).to_dict()
    assert call["sampling_params"] == {**default_sampling_params(), **run_values, **gen_values}
    assert (call["return_logprob"], call["top_logprobs_num"]) == (True, 2)
    error = one.run(backend=LocalBackend(runtime), top_k=-3).error()
    assert isinstance(error, InvalidRequestError)
    assert "top_k must be -1 (all) or >= 1, got -3" in str(error)
    assert len(runtime.calls) == 1  # refused before any request


def test_a_list_of_stop_regexes_cuts_at_the_first_match_of_any() -> None:
    runtime = FakeRuntime(["ab1", "2cd", "efg"])

    @lmnb.function
    def stopped(s):
        s += "Q: " + gen("a", stop_regex=["f+", r"\d{2}", "never"])
        s += "|" + gen("b")

    state = stopped.run(backend=LocalBackend(runtime), stop_regex=["cd"], temperature=0)
    assert state["a"] == "ab"  # "12" starts before "f"
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": "12"}
    assert state["b"] == "ab12"  # the run's default stop_regex
    assert state.get_meta_info("b")["finish_reason"] == {"type": "stop", "matched": "cd"}
    assert state.text() == "Q: ab|ab12"
    assert runtime.closed  # the rest of the stream was closed (aborted)
    assert runtime.calls[0]["sampling_params"]["stop_regex"] == ["f+", r"\d{2}", "never"]
    assert runtime.calls[0]["sampling_params"]["temperature"] == 0
