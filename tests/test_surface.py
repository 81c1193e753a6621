"""`EngineSurface`: both runtimes implement it (checked on the classes, no model load; the live
`isinstance` checks are in test_runtime_api.py and test_dp.py), and `request_checks` raises the
errors both runtimes share."""

from __future__ import annotations

import inspect
import re

import pytest

from lmnb.params import InvalidRequestError, SamplingParams
from lmnb.runtime import request_checks
from lmnb.runtime.distributed.dp_runtime import DataParallelRuntime
from lmnb.runtime.engine import Runtime
from lmnb.runtime.surface import EngineSurface
from lmnb.server.streams import ServedRuntime

RUNTIMES = [Runtime, DataParallelRuntime]


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(EngineSurface).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def _protocol_properties() -> list[str]:
    return [name for name, member in vars(EngineSurface).items() if isinstance(member, property)]


@pytest.mark.parametrize("cls", RUNTIMES, ids=lambda c: c.__name__)
def test_runtime_class_has_every_method_with_the_protocol_parameters(cls: type) -> None:
    methods = _protocol_methods()
    assert {"generate", "encode", "apply_chat_template", "stats", "flush_cache",
            "cache_prefix", "close"} <= set(methods)
    for name, expected in methods.items():
        got = inspect.signature(getattr(cls, name))
        for param in expected.parameters.values():
            assert param.name in got.parameters, f"{cls.__name__}.{name} lacks {param.name}"
            actual = got.parameters[param.name]
            assert actual.kind == param.kind, f"{cls.__name__}.{name}({param.name}) kind"
            assert actual.default == param.default, f"{cls.__name__}.{name}({param.name})"
        extra = [p for p in got.parameters.values() if p.name not in expected.parameters
                 and p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not extra, f"{cls.__name__}.{name} requires {extra} beyond the protocol"
    for name in _protocol_properties():
        assert isinstance(inspect.getattr_static(cls, name), property), (cls, name)


@pytest.mark.parametrize("cls", RUNTIMES, ids=lambda c: c.__name__)
def test_runtime_class_sets_every_protocol_attribute(cls: type) -> None:
    source = inspect.getsource(cls.__init__)
    for name in EngineSurface.__annotations__:
        assert re.search(rf"self\.{name}\b[^=\n]*=", source), f"{cls.__name__} never sets {name}"


def test_server_protocol_is_the_engine_surface() -> None:
    assert ServedRuntime is EngineSurface


def test_params_list_and_dicts() -> None:
    shared = request_checks.params_list({"max_new_tokens": 3}, 2)
    assert shared[0] is shared[1] and shared[0].max_new_tokens == 3
    assert [p.n for p in request_checks.params_list([{"n": 2}, None], 2)] == [2, 1]
    assert request_checks.params_dicts([{"n": 2}, None], 2) == [{"n": 2}, {}]
    dicts = request_checks.params_dicts(None, 2)
    assert dicts == [{}, {}] and dicts[0] is not dicts[1]
    for build in (request_checks.params_list, request_checks.params_dicts):
        with pytest.raises(InvalidRequestError, match="1 sampling_params for 2 prompts"):
            build([{}], 2)
    with pytest.raises(InvalidRequestError, match="unknown sampling params"):
        request_checks.params_list([{"bogus": 1}], 1)


def test_logprob_options() -> None:
    options = request_checks.logprob_options
    assert options(False, 3, 5, vocab_size=10) == (-1, 0)
    assert options(True, None, None, vocab_size=10) == (-1, 0)
    assert options(True, 2, 5, vocab_size=10) == (2, 5)
    with pytest.raises(InvalidRequestError, match=r"top_logprobs_num must be in \[0, 10\], got 11"):
        options(True, None, 11, vocab_size=10)


def test_logprob_options_per_prompt() -> None:
    """SGLang's three logprob fields: one value for every prompt, or for a list of prompts one
    per prompt; token origins (`always`) ask every prompt for logprobs."""
    per_prompt = request_checks.logprob_options_per_prompt
    Options = request_checks.LogprobOptions
    assert per_prompt(True, 1, 2, count=2, is_batch=True, vocab_size=10) == [
        Options(True, 1, 2)] * 2
    assert per_prompt([True, False], [None, 3], 4, count=2, is_batch=True, vocab_size=10) == [
        Options(True, -1, 4), Options(False, -1, 0)]
    assert per_prompt([False, False], 1, None, count=2, is_batch=True, vocab_size=10,
                      always=True) == [Options(True, 1, 0)] * 2
    with pytest.raises(InvalidRequestError, match="top_logprobs_num has 1 values for 2 prompts"):
        per_prompt(True, None, [1], count=2, is_batch=True, vocab_size=10)
    with pytest.raises(InvalidRequestError, match="return_logprob: a list gives one value per"):
        per_prompt([True], None, None, count=1, is_batch=False, vocab_size=10)
    with pytest.raises(InvalidRequestError, match=r"top_logprobs_num must be in \[0, 10\]"):
        per_prompt([True, False], None, [1, 11], count=2, is_batch=True, vocab_size=10)
    assert request_checks.token_ids_option([[1], [2]], return_logprob=[True, False], count=2,
                                           is_batch=True, vocab_size=10) == [[1], None]


def test_check_prompt_errors_refusals_and_cuts() -> None:
    """A prompt that fills the context, or whose max_new_tokens do not fit after it, is refused
    naming the numbers (SGLang's and vLLM's servers); `allow_auto_truncate` (SGLang's option)
    cuts max_new_tokens instead; None (no limit) is the room; an exact fit is kept."""
    params = SamplingParams.from_dict({"max_new_tokens": 100, "min_new_tokens": 50})

    def check(ids: list[int], logprob_start: int = -1, **kwargs) -> SamplingParams:
        return request_checks.check_prompt(ids, kwargs.pop("params", params), context_len=8,
                                           vocab_size=10, logprob_start=logprob_start, **kwargs)

    with pytest.raises(InvalidRequestError, match="empty prompt"):
        check([])
    with pytest.raises(InvalidRequestError, match=r"input_ids must be ints in \[0, 10\)"):
        check([1, 10])
    with pytest.raises(InvalidRequestError, match="the prompt has 8 tokens, but this model's "
                                                  "maximum context length is 8 tokens"):
        check([1] * 8, allow_auto_truncate=True)
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 8 tokens\. "
                       r"However, you requested 103 tokens \(3 in the messages, 100 in the "
                       r"completion\).*at most 5 fit"):
        check([1, 2, 3])
    with pytest.raises(InvalidRequestError, match="logprob_start_len 3 is past the prompt's 3"):
        check([1, 2, 3], logprob_start=3, params=SamplingParams(max_new_tokens=1))
    cut = check([1, 2, 3], allow_auto_truncate=True)
    assert (cut.max_new_tokens, cut.min_new_tokens) == (5, 5)
    assert check([1, 2, 3], ids_trusted=True, allow_auto_truncate=True).max_new_tokens == 5
    unlimited = check([1, 2, 3], params=SamplingParams.from_dict({"max_new_tokens": None}))
    assert unlimited.max_new_tokens == 5
    exact = SamplingParams.from_dict({"max_new_tokens": 5})
    assert check([1, 2, 3], params=exact) is exact
    with pytest.raises(InvalidRequestError, match="you requested 9 tokens"):
        check([1, 2, 3], params=SamplingParams(max_new_tokens=6))
