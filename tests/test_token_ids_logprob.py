"""SGLang's `token_ids_logprob` through `Runtime.generate` on the tiny Llama: the logprobs of the
named ids at every output and prompt position equal HF's log_softmax, with and without a prefix
cache hit, batched beside requests that do not ask; `max_new_tokens` 0 scores the next token;
bad ids are `InvalidRequestError`s that name them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmnb.runtime.core import InvalidRequestError
from lmnb.runtime.engine import Runtime
from lmnb.runtime.output.logprob_lists import OutputLists

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["llama-gqa"]


@pytest.fixture(scope="module")
def rt(model_dir) -> Iterator[Runtime]:
    runtime = Runtime(model_dir, max_total_tokens=4096, check_integrity_each_step=True)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of HF's logits; row t scores the token at t + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_row(row: list[tuple[float, int]], ref_row: torch.Tensor, ids: list[int]) -> None:
    assert [t for _, t in row] == ids
    for (value, token) in row:
        assert abs(value - ref_row[token].item()) < TOL, (token, value, ref_row[token].item())


def assert_matches_hf(out: dict, hf_model, prompt: list[int], ids: list[int],
                      logprob_start_len: int | None) -> None:
    meta = out["meta_info"]
    ref = hf_logprobs(hf_model, prompt + out["output_ids"])
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(out["output_ids"]) > 0
    for i, row in enumerate(rows):
        assert_row(row, ref[len(prompt) - 1 + i], ids)
    if logprob_start_len is None:
        assert meta["input_token_ids_logprobs"] == []  # as SGLang's: no prompt positions
        return
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == len(prompt) - logprob_start_len
    assert len(inputs) == len(meta["input_token_logprobs"])
    for offset, row in enumerate(inputs):
        t = logprob_start_len + offset
        if t == 0:
            assert row is None  # the first prompt token has no logprob
        else:
            assert_row(row, ref[t - 1], ids)


def test_output_and_prompt_logprobs_match_hf(rt: Runtime, hf_model) -> None:
    prompt = rt.encode("Token ids logprob: the capital of France is")
    ids = [rt.model_config.vocab_size - 1, 0, prompt[3], 17, 17]  # any order, duplicates kept
    out = rt.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                      logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=ids)
    assert out["meta_info"]["cached_tokens"] == 0
    assert_matches_hf(out, hf_model, prompt, ids, logprob_start_len=0)
    # the top logprobs beside them are still the top logprobs
    ref = hf_logprobs(hf_model, prompt + out["output_ids"])
    for i, top in enumerate(out["meta_info"]["output_top_logprobs"]):
        assert [t for _, t in top] == ref[len(prompt) - 1 + i].topk(2).indices.tolist()
    texts = rt.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                        token_ids_logprob=ids, return_text_in_logprobs=True)
    first = texts["meta_info"]["output_token_ids_logprobs"][0]
    assert [text for _, _, text in first] == [
        rt.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_streamed_texts_in_logprobs_are_triples_in_every_chunk(rt: Runtime) -> None:
    """`return_text_in_logprobs` with `stream=True`: a running chunk's `new_*` rows are
    `(logprob, id, text)` triples too, as every event of SGLang's stream; put together from
    `output_ids_from` they are the last chunk's lists."""
    prompt = rt.encode("Streamed logprob texts: one two three")
    chunks = list(rt.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                              top_logprobs_num=2, token_ids_logprob=[0, 17, prompt[2]],
                              return_text_in_logprobs=True, stream=True))
    *running, last = (chunk["meta_info"] for chunk in chunks)
    assert running and all("new_token_logprobs" in meta for meta in running)

    def text_of(token_id: int) -> str:
        return rt.tokenizer.decode([token_id], skip_special_tokens=False)

    lists = OutputLists()
    for meta in running:
        for key, rows in (("new_token_logprobs", [meta["new_token_logprobs"]]),
                          ("new_top_logprobs", meta["new_top_logprobs"]),
                          ("new_token_ids_logprobs", meta["new_token_ids_logprobs"])):
            for row in rows:
                assert [tuple(item[1:]) for item in row] == [
                    (token_id, text_of(token_id)) for _, token_id, *_ in row], key
        lists.add(meta)
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        assert len(lists.rows(key)) == len(last[key]) - 1 == GREEDY["max_new_tokens"] - 1
        assert lists.rows(key) == last[key][:-1], key


def test_prefix_cache_hit_changes_nothing(rt: Runtime, hf_model) -> None:
    prompt = rt.encode("A prefix cached before the request that asks for token ids: one two")
    ids = [5, prompt[-1], 1000]
    rt.generate(input_ids=prompt, sampling_params=GREEDY)  # caches the prompt
    for start in (None, 0, 4):
        out = rt.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=start, token_ids_logprob=ids)
        if start is None:  # output logprobs only: the prompt is a hit
            assert out["meta_info"]["cached_tokens"] > 0
        assert_matches_hf(out, hf_model, prompt, ids, logprob_start_len=start)


def test_batched_beside_requests_that_do_not_ask(rt: Runtime, hf_model) -> None:
    prompts = [rt.encode(text) for text in ("Batched one: red green", "Batched two: up down",
                                            "Batched three: left right")]
    plain_ref = rt.generate(input_ids=prompts[1], sampling_params=GREEDY)
    per_prompt = [[3, 900], None, [42]]
    with rt.batched_submits():  # one pass: a request asking no logprobs at all beside them
        plain = rt.generate(input_ids=prompts[1], sampling_params=GREEDY, stream=True,
                            incremental=False)
        asking = rt.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                             logprob_start_len=1, token_ids_logprob=per_prompt, stream=True,
                             incremental=False)
    outs = asking.results()
    assert plain.results()[0]["output_ids"] == plain_ref["output_ids"]
    for prompt, ids, out in zip(prompts, per_prompt, outs, strict=True):
        if ids is None:
            assert "output_token_ids_logprobs" not in out["meta_info"]
            assert "input_token_ids_logprobs" not in out["meta_info"]
            assert out["output_ids"] == plain_ref["output_ids"]
        else:
            assert_matches_hf(out, hf_model, prompt, ids, logprob_start_len=1)
    one_list = rt.generate(input_ids=prompts[:2], sampling_params=GREEDY, return_logprob=True,
                           token_ids_logprob=[7, 8])  # one list: every prompt's
    for prompt, out in zip(prompts[:2], one_list, strict=True):
        assert_matches_hf(out, hf_model, prompt, [7, 8], logprob_start_len=None)


def test_max_new_tokens_0_scores_the_next_token(rt: Runtime, hf_model) -> None:
    prompt = rt.encode("Scoring: is the answer yes or no? The answer is")
    ids = [rt.encode(" yes")[-1], rt.encode(" no")[-1]]
    out = rt.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                      return_logprob=True, token_ids_logprob=ids)
    assert out["output_ids"] == []
    rows = out["meta_info"]["output_token_ids_logprobs"]
    assert len(rows) == 1
    assert_row(rows[0], hf_logprobs(hf_model, prompt)[-1], ids)


def test_ignored_without_return_logprob(rt: Runtime) -> None:
    out = rt.generate("No logprobs asked", GREEDY, token_ids_logprob=[1, 2])
    assert "output_token_ids_logprobs" not in out["meta_info"]
    empty = rt.generate("An empty list", GREEDY, return_logprob=True, token_ids_logprob=[])
    assert "output_token_ids_logprobs" not in empty["meta_info"]


BAD = {
    "past-vocab": (dict(prompt="hi"), [49152], "49152"),
    "negative": (dict(prompt="hi"), [3, -1], "-1"),
    "float": (dict(prompt="hi"), [2.0], "2.0"),
    "string": (dict(prompt="hi"), ["3"], "'3'"),
    "bool": (dict(prompt="hi"), [True], "True"),
    "scalar": (dict(prompt="hi"), 3, "3"),
    "nested-for-one-prompt": (dict(prompt="hi"), [[3]], "[[3]]"),
    "lists-count": (dict(prompt=["a", "b"]), [[3]], "1 token_ids_logprob lists for 2 prompts"),
    "bad-in-a-prompt's-list": (dict(prompt=["a", "b"]), [[3], [4, "x"]], "'x'"),
}


@pytest.mark.parametrize(("kwargs", "token_ids", "named"), BAD.values(), ids=BAD.keys())
def test_bad_token_ids_are_named(rt: Runtime, kwargs: dict, token_ids: object,
                                 named: str) -> None:
    with pytest.raises(InvalidRequestError, match="token_ids_logprob") as error:
        rt.generate(**kwargs, sampling_params=GREEDY, return_logprob=True,
                    token_ids_logprob=token_ids)
    assert named in str(error.value)
    assert rt.stats()["running"] == 0
