"""Token origins in `meta_info` (`return_token_origins`): the cached prompt prefix, tokens forced
by jump-forward, streamed chunks that rebuild the final output, and nothing for requests that do
not ask. One tiny runtime for the module."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from lmnb.runtime.engine import Runtime
from lmnb.runtime.output.token_origins import (
    CACHED,
    COMPUTED,
    GENERATED,
    JUMP_FORWARD,
    SPECULATED,
    OutputOrigins,
    accept_speculated,
    count_origin,
    prompt_spans,
)

PREFIX = "You are a careful assistant. Answer every question in one short sentence.\n"
REGEX = r" The answer is (yes|no)\."


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    with Runtime(tiny_models["llama-gqa"], device="cpu", max_total_tokens=2048,
                 check_integrity_each_step=True) as runtime:
        yield runtime


def test_output_origins_runs_and_speculation_hook() -> None:
    origins = OutputOrigins()
    origins.add(GENERATED, 2)
    origins.add(JUMP_FORWARD, 3)
    origins.add(GENERATED)
    assert origins.spans() == [(GENERATED, 0, 2), (JUMP_FORWARD, 2, 5), (GENERATED, 5, 6)]
    origins.truncate(3)  # a jump re-tokenized from position 3 on
    assert origins.spans() == [(GENERATED, 0, 2), (JUMP_FORWARD, 2, 3)] and len(origins) == 3
    accept_speculated(origins, 2)
    accept_speculated(None, 5)  # a request that did not ask: nothing to do
    assert origins.spans()[-1] == (SPECULATED, 3, 5)
    origins.truncate(0)
    assert origins.spans() == []
    assert prompt_spans(5, 0) == [(COMPUTED, 0, 5)]
    assert prompt_spans(5, 5) == [(CACHED, 0, 5)]


def test_cached_prefix_and_jump_forward_origins(rt: Runtime) -> None:
    question = "Is the sky blue?\nAnswer:"
    rt.cache_prefix(PREFIX)
    prompt_ids, prefix_ids = rt.encode(PREFIX + question), rt.encode(PREFIX)
    pairs = zip(prompt_ids, prefix_ids, strict=False)
    shared = next((i for i, (a, b) in enumerate(pairs) if a != b),
                  min(len(prompt_ids), len(prefix_ids)))
    jumped_before = rt.stats()["jump_forward_tokens"]
    out = rt.generate(PREFIX + question, {"regex": REGEX, "temperature": 0,
                                          "max_new_tokens": 24},
                      return_token_origins=True, top_logprobs_num=3)
    meta = out["meta_info"]
    assert meta["cached_tokens"] == shared > 0
    assert meta["prompt_token_origins"] == [(CACHED, 0, shared),
                                            (COMPUTED, shared, len(prompt_ids))]
    spans = meta["output_token_origins"]
    assert [s[1:] for s in spans] == [(a, b) for a, b in zip(
        [0, *(s[2] for s in spans[:-1])], [s[2] for s in spans], strict=True)]  # contiguous
    assert spans[-1][2] == meta["completion_tokens"] == len(out["output_ids"])
    jumped = count_origin(spans, JUMP_FORWARD)
    assert 0 < jumped <= rt.stats()["jump_forward_tokens"] - jumped_before
    # jumped tokens spell only forced text and have no logprob; generated ones were sampled
    tokenizer = rt.tokenizer
    for origin, start, end in spans:
        text = tokenizer.decode(out["output_ids"][start:end])
        logprobs = [lp for lp, _ in meta["output_token_logprobs"][start:end]]
        if origin == JUMP_FORWARD:
            assert text in " The answer is " or text == ".", (text, spans)
            assert all(lp is None for lp in logprobs)
    assert re.fullmatch(REGEX, out["text"])
    generated = "".join(tokenizer.decode(out["output_ids"][s:e]) for o, s, e in spans
                        if o == GENERATED)
    assert re.search("yes|no", generated), (generated, spans)


def test_streamed_chunks_rebuild_the_output(rt: Runtime) -> None:
    params = {"regex": REGEX, "temperature": 1.0, "seed": 7, "max_new_tokens": 24}
    whole = rt.generate("Q: Is water wet?\nA:", params, return_token_origins=True)
    ids: list[int] = []
    logprobs: list = []
    final = None
    for chunk in rt.generate("Q: Is water wet?\nA:", params, return_token_origins=True,
                             stream=True):
        meta = chunk["meta_info"]
        if meta["finish_reason"] is not None:
            final = meta
        at = meta.get("output_ids_from", len(ids))
        ids = ids[:at] + chunk["output_ids"]
        logprobs = logprobs[:at] + meta.get("new_token_logprobs", [])
        if "output_ids_from" in meta:
            assert meta["output_token_origins"][-1][2] == len(ids)
    assert ids == whole["output_ids"]
    assert final["output_token_origins"] == whole["meta_info"]["output_token_origins"]
    assert logprobs == final["output_token_logprobs"][:len(logprobs)]


def test_requests_that_do_not_ask_carry_no_origins(rt: Runtime) -> None:
    out = rt.generate("Hello", {"max_new_tokens": 3, "temperature": 0})
    assert "output_token_origins" not in out["meta_info"]
    assert "output_token_logprobs" not in out["meta_info"]
    for chunk in rt.generate("Hello", {"max_new_tokens": 3, "temperature": 0}, stream=True):
        assert "output_ids_from" not in chunk["meta_info"]
