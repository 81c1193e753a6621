"""`Runtime.generate` end to end on a tiny random-weight Llama (GQA) with SmolLM2's tokenizer:
result shapes, sampling, stops, logprobs against HF transformers, streaming, errors, threads,
aborts, close, retraction and chunked prefill. Every runtime checks KV integrity after each step."""

from __future__ import annotations

import _thread
import asyncio
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmnb.runtime.core import InvalidRequestError
from lmnb.runtime.engine import Runtime

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water?\nA:",
    "Roses are red, violets are",
    "import numpy as np\nx = np.",
    "The quick brown fox",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
GUARD_S = 60.0  # bounds a failing (hung) test only; no assertion depends on speed


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


def idle(rt: Runtime, timeout: float = GUARD_S) -> dict:
    """Polls until no request is running or waiting; returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = rt.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still live: {stats}"
        time.sleep(0.02)


def assert_no_kv_held(stats: dict) -> None:
    """Idle: every KV slot is free or held by the prefix cache, evictable."""
    assert stats["protected_tokens"] == 0
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["max_total_tokens"]


def assert_usable(rt: Runtime) -> None:
    out = rt.generate(PROMPTS[0], {"temperature": 0.0, "max_new_tokens": 3})
    assert len(out["output_ids"]) == 3
    rt.check_integrity()


# ---- result shapes -------------------------------------------------------------------------

def test_runtime_is_an_engine_surface(rt: Runtime) -> None:
    from lmnb.runtime.surface import EngineSurface

    assert isinstance(rt, EngineSurface)


def test_single_prompt_result(rt: Runtime) -> None:
    prompt = "A prompt used by this test only:"
    out = rt.generate(prompt, GREEDY)
    assert isinstance(out, dict)
    prompt_ids = rt.tokenizer.encode(prompt)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["completion_tokens"] == 12 == len(out["output_ids"])
    assert meta["cached_tokens"] == 0
    again = rt.generate(prompt, GREEDY)  # the prompt is cached now; the result is the same
    assert again["output_ids"] == out["output_ids"]
    assert 0 < again["meta_info"]["cached_tokens"] < len(prompt_ids)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    vocab_size = rt.model_config.vocab_size
    assert all(isinstance(t, int) and 0 <= t < vocab_size for t in out["output_ids"])
    assert out["text"] == rt.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"]


def test_sglang_meta_info_fields(rt: Runtime, model_dir: Path) -> None:
    """SGLang 0.5's meta_info names: weight_version (the server argument), total_retractions,
    reasoning_tokens (0 without require_reasoning), output_token_logprobs_length."""
    meta = rt.generate(PROMPTS[1], GREEDY, return_logprob=True)["meta_info"]
    assert meta["weight_version"] == "default"
    assert meta["total_retractions"] == meta["retractions"] == 0
    assert meta["reasoning_tokens"] == 0
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == 12
    assert "output_token_logprobs_length" not in rt.generate(PROMPTS[1], GREEDY)["meta_info"]
    with Runtime(model_dir, max_total_tokens=512, weight_version="step-7") as labelled:
        assert labelled.generate(PROMPTS[1], GREEDY)["meta_info"]["weight_version"] == "step-7"


def test_list_of_prompts_and_input_ids(rt: Runtime) -> None:
    singles = [rt.generate(p, GREEDY) for p in PROMPTS[:3]]
    batch = rt.generate(PROMPTS[:3], GREEDY)
    assert isinstance(batch, list) and len(batch) == 3
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert [b["text"] for b in batch] == [s["text"] for s in singles]

    ids = [rt.tokenizer.encode(p) for p in PROMPTS[:3]]
    one = rt.generate(input_ids=ids[0], sampling_params=GREEDY)
    assert isinstance(one, dict)
    assert one["output_ids"] == singles[0]["output_ids"]
    assert one["meta_info"]["prompt_tokens"] == len(ids[0])
    many = rt.generate(input_ids=ids, sampling_params=GREEDY)
    assert isinstance(many, list)
    assert [m["output_ids"] for m in many] == [s["output_ids"] for s in singles]

    # one sampling_params per prompt
    lengths = [2, 5, 7]
    per = rt.generate(PROMPTS[:3], [{"temperature": 0.0, "max_new_tokens": n} for n in lengths])
    assert [len(p["output_ids"]) for p in per] == lengths
    for p, s in zip(per, singles, strict=True):
        assert p["output_ids"] == s["output_ids"][:len(p["output_ids"])]
    rt.check_integrity()


# ---- sampling --------------------------------------------------------------------------------

def test_greedy_is_deterministic(rt: Runtime) -> None:
    a = rt.generate(PROMPTS[1], {"temperature": 0.0, "max_new_tokens": 20})
    b = rt.generate(PROMPTS[1], {"temperature": 0.0, "max_new_tokens": 20})
    assert a["output_ids"] == b["output_ids"]
    top_k_1 = rt.generate(PROMPTS[1], {"top_k": 1, "max_new_tokens": 20})
    assert top_k_1["output_ids"] == a["output_ids"]


def test_seed_makes_sampling_reproducible(rt: Runtime) -> None:
    params = {"temperature": 1.5, "max_new_tokens": 16}
    a = rt.generate(PROMPTS[2], {**params, "seed": 1234})
    b = rt.generate(PROMPTS[2], {**params, "seed": 1234})
    assert a["output_ids"] == b["output_ids"]
    others = [rt.generate(PROMPTS[2], {**params, "seed": s})["output_ids"] for s in (1, 2, 3)]
    assert any(o != a["output_ids"] for o in others)
    greedy = rt.generate(PROMPTS[2], {"temperature": 0.0, "max_new_tokens": 16})
    assert any(o != greedy["output_ids"] for o in [a["output_ids"], *others])


def test_n_samples(rt: Runtime) -> None:
    params = {"temperature": 1.5, "max_new_tokens": 10, "n": 3}
    outs = rt.generate(PROMPTS[3], params)
    assert isinstance(outs, list) and len(outs) == 3
    assert all(len(o["output_ids"]) == 10 for o in outs)

    seeded = {**params, "seed": 7}
    first = [o["output_ids"] for o in rt.generate(PROMPTS[3], seeded)]
    second = [o["output_ids"] for o in rt.generate(PROMPTS[3], seeded)]
    assert first == second
    assert len({tuple(ids) for ids in first}) > 1  # the n samples are not all the same

    # n per prompt, consecutive
    both = rt.generate(PROMPTS[3:5], {"temperature": 0.0, "max_new_tokens": 4, "n": 2})
    assert len(both) == 4
    assert both[0]["output_ids"] == both[1]["output_ids"]
    assert both[2]["output_ids"] == both[3]["output_ids"]
    assert both[0]["meta_info"]["prompt_tokens"] == len(rt.tokenizer.encode(PROMPTS[3]))
    assert both[2]["meta_info"]["prompt_tokens"] == len(rt.tokenizer.encode(PROMPTS[4]))


# ---- lengths and stops -----------------------------------------------------------------------

def test_max_new_tokens_zero(rt: Runtime) -> None:
    out = rt.generate(PROMPTS[0], {"max_new_tokens": 0})
    assert out["output_ids"] == []
    assert out["text"] == ""
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    rt.check_integrity()


def greedy_ids(rt: Runtime, prompt: str, n: int = 24) -> list[int]:
    return rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": n})["output_ids"]


def first_new_token_at(ids: list[int], start: int) -> int:
    """Index j >= start of the first token that does not occur earlier in `ids`."""
    for j in range(start, len(ids)):
        if ids[j] not in ids[:j]:
            return j
    raise AssertionError(f"greedy output {ids} has no fresh token at or after {start}")


def test_stop_token_ids_and_min_new_tokens(rt: Runtime) -> None:
    prompt = PROMPTS[2]
    g = greedy_ids(rt, prompt)
    j = first_new_token_at(g, 2)
    stop_id = g[j]
    out = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                               "stop_token_ids": [stop_id]})
    assert out["output_ids"] == g[:j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == rt.tokenizer.decode(g[:j], skip_special_tokens=True)

    # min_new_tokens forbids the stop id before it is reached
    blocked = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                                   "stop_token_ids": [stop_id], "min_new_tokens": j + 2})
    ids = blocked["output_ids"]
    assert len(ids) >= j + 2
    assert ids[:j] == g[:j]
    assert stop_id not in ids[:j + 2]
    reason = blocked["meta_info"]["finish_reason"]
    assert reason in ({"type": "length", "length": 24}, {"type": "stop", "matched": stop_id})

    # min_new_tokens with ignore_eos runs to max_new_tokens
    full = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 9, "min_new_tokens": 9,
                                "ignore_eos": True})
    assert full["output_ids"] == g[:9]
    assert full["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    rt.check_integrity()


def test_eos_from_generation_config(rt: Runtime, model_dir: Path, tmp_path: Path) -> None:
    """A model whose EOS is a token the greedy run produces stops there unless ignore_eos."""
    prompt = PROMPTS[4]
    g = greedy_ids(rt, prompt)
    j = first_new_token_at(g, 2)
    eos = g[j]
    folder = tmp_path / "eos-model"
    shutil.copytree(model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    with Runtime(folder, max_total_tokens=512, check_integrity_each_step=True) as eos_rt:
        assert eos in eos_rt.eos_token_ids and 2 in eos_rt.eos_token_ids
        out = eos_rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24})
        assert out["output_ids"] == g[:j + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert out["text"] == rt.tokenizer.decode(g[:j], skip_special_tokens=True)

        ignored = eos_rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                                           "ignore_eos": True})
        assert ignored["output_ids"] == g
        assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 24}

        late = eos_rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                                        "min_new_tokens": j + 1})
        assert late["output_ids"][:j] == g[:j]
        assert late["output_ids"][j] != eos
        assert len(late["output_ids"]) >= j + 1
        eos_rt.check_integrity()


def test_stop_regex_ends_generation_and_cuts_the_text(rt: Runtime) -> None:
    prompt = PROMPTS[5]
    g = greedy_ids(rt, prompt, 24)
    text = rt.tokenizer.decode(g, skip_special_tokens=True)
    word = next(w for w in text.split() if w.isalpha() and len(w) >= 3)
    pattern = f"{word[0]}[a-z]{{{len(word) - 2}}}{word[-1]}"
    at = re.search(pattern, text).start()
    out = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                               "stop_regex": ["zzzq", pattern]})
    assert out["text"] == text[:at]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(pattern, out["meta_info"]["finish_reason"]["matched"])
    n = len(out["output_ids"])
    assert out["output_ids"] == g[:n] and n < 24  # generation stopped at the match
    assert re.search(pattern, rt.tokenizer.decode(g[:n], skip_special_tokens=True))
    assert not re.search(pattern, rt.tokenizer.decode(g[:n - 1], skip_special_tokens=True))
    rt.check_integrity()


def test_stop_string_across_token_boundary(rt: Runtime) -> None:
    prompt = PROMPTS[5]
    g = greedy_ids(rt, prompt, 24)
    text = rt.tokenizer.decode(g, skip_special_tokens=True)
    stop = None
    for k in range(1, len(g) - 1):
        boundary = len(rt.tokenizer.decode(g[:k], skip_special_tokens=True))
        candidate = text[boundary - 2:boundary + 2]
        if (boundary >= 2 and len(candidate) == 4 and candidate.strip()
                and text.find(candidate) == boundary - 2):
            stop = candidate
            break
    assert stop is not None, f"no usable token boundary in {text!r}"
    at = text.index(stop)
    out = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24, "stop": [stop]})
    assert out["text"] == text[:at]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    n = len(out["output_ids"])
    assert out["output_ids"] == g[:n]
    # generation stops at the token that completes the stop string
    assert stop in rt.tokenizer.decode(g[:n], skip_special_tokens=True)
    assert stop not in rt.tokenizer.decode(g[:n - 1], skip_special_tokens=True)

    # a plain string works too; a stop string that never appears changes nothing
    same = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24, "stop": stop})
    assert same["text"] == out["text"]
    never = rt.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24,
                                 "stop": ["\x00never\x00"]})
    assert never["output_ids"] == g and never["text"] == text
    rt.check_integrity()


# ---- logprobs --------------------------------------------------------------------------------

def test_logprobs_match_hf(rt: Runtime, hf_model) -> None:
    prompt_ids = rt.tokenizer.encode(PROMPTS[4])
    out = rt.generate(input_ids=prompt_ids, sampling_params={"temperature": 0.0,
                                                             "max_new_tokens": 8},
                      return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    meta = out["meta_info"]
    output_ids = out["output_ids"]
    ref = hf_logprobs(hf_model, prompt_ids + output_ids)
    p = len(prompt_ids)

    inputs = meta["input_token_logprobs"]
    assert len(inputs) == p
    assert inputs[0] == (None, prompt_ids[0])
    for t in range(1, p):
        logprob, token = inputs[t]
        assert token == prompt_ids[t]
        assert abs(logprob - ref[t - 1, token].item()) < 1e-4
    assert len(meta["input_top_logprobs"]) == p
    for t in range(1, p):
        top = meta["input_top_logprobs"][t]
        values, ids = ref[t - 1].topk(3)
        assert [i for _, i in top] == ids.tolist()
        assert all(abs(v - r) < 1e-4 for (v, _), r in zip(top, values.tolist(), strict=True))

    outputs = meta["output_token_logprobs"]
    assert [token for _, token in outputs] == output_ids
    assert len(meta["output_top_logprobs"]) == len(output_ids)
    for i, (logprob, token) in enumerate(outputs):
        row = ref[p - 1 + i]
        assert abs(logprob - row[token].item()) < 1e-4
        top = meta["output_top_logprobs"][i]
        assert len(top) == 3
        values = [v for v, _ in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == token == int(row.argmax())  # greedy picks the top-1
        assert abs(top[0][0] - logprob) < 1e-6
        ref_values, ref_ids = row.topk(3)
        assert [i for _, i in top] == ref_ids.tolist()
        assert all(abs(v - r) < 1e-4 for v, r in zip(values, ref_values.tolist(), strict=True))


def test_logprob_start_len(rt: Runtime, hf_model) -> None:
    prompt_ids = rt.tokenizer.encode(PROMPTS[1])
    p = len(prompt_ids)
    ref = hf_logprobs(hf_model, prompt_ids)
    for k in (1, 3, p - 1):
        out = rt.generate(input_ids=prompt_ids, sampling_params={"temperature": 0.0,
                                                                 "max_new_tokens": 2},
                          return_logprob=True, logprob_start_len=k)
        inputs = out["meta_info"]["input_token_logprobs"]
        assert len(inputs) == p - k
        assert [t for _, t in inputs] == prompt_ids[k:]
        for offset, (logprob, token) in enumerate(inputs):
            assert abs(logprob - ref[k + offset - 1, token].item()) < 1e-4
        assert len(out["meta_info"]["output_token_logprobs"]) == 2
    # without logprob_start_len, only output logprobs (the prompt's list empty, as SGLang's)
    out = rt.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 2},
                      return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 2
    plain = rt.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 2})
    assert "output_token_logprobs" not in plain["meta_info"]


# ---- streaming -------------------------------------------------------------------------------

def test_stream_matches_non_stream(rt: Runtime) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 20}
    full = rt.generate(PROMPTS[6], params)
    chunks = list(rt.generate(PROMPTS[6], params, stream=True))
    assert len(chunks) >= 2
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert chunks[0]["meta_info"]["prompt_tokens"] == full["meta_info"]["prompt_tokens"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_slow_stream_consumer_gets_everything(rt: Runtime) -> None:
    """The request finishes while the caller still holds unread chunks: none may be lost, and
    only the last one carries the finish reason."""
    params = {"temperature": 0.0, "max_new_tokens": 20}
    full = rt.generate(PROMPTS[6], params)
    stream = rt.generate(PROMPTS[6], params, stream=True)
    chunks = [next(stream)]
    time.sleep(0.5)  # the request is done long before the next read
    chunks += list(stream)
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks].count(True) == 1
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}


def test_stream_batch_is_tagged(rt: Runtime) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 10}
    full = rt.generate(PROMPTS[:3], params)
    texts = ["", "", ""]
    ids: list[list[int]] = [[], [], []]
    finished = [0, 0, 0]
    for chunk in rt.generate(PROMPTS[:3], params, stream=True):
        i = chunk["index"]
        texts[i] += chunk["text"]
        ids[i] += chunk["output_ids"]
        finished[i] += chunk["meta_info"]["finish_reason"] is not None and not finished[i]
    assert finished == [1, 1, 1]
    assert texts == [f["text"] for f in full]
    assert ids == [f["output_ids"] for f in full]


def test_stream_consumed_from_asyncio(rt: Runtime) -> None:
    """The stream an asyncio task reads (the server's case): same chunks as a thread reads, and
    cancelling the task aborts the request."""
    params = {"temperature": 0.0, "max_new_tokens": 12}
    full = rt.generate(PROMPTS[2:4], params)

    async def consume() -> list[dict]:
        return [chunk async for chunk in rt.generate(PROMPTS[2:4], params, stream=True)]

    chunks = asyncio.run(consume())
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == full[i]["text"]
        assert [t for c in mine for t in c["output_ids"]] == full[i]["output_ids"]

    async def cancel_midway() -> None:
        stream = rt.generate(PROMPTS[7], {"max_new_tokens": 400, "ignore_eos": True},
                             stream=True)
        first = asyncio.Event()

        async def reader() -> None:
            async for _ in stream:
                first.set()

        task = asyncio.create_task(reader())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert_no_kv_held(idle(rt))
    rt.check_integrity()


def test_breaking_out_of_stream_aborts(rt: Runtime) -> None:
    before = rt.stats()["generated_tokens"]
    for chunk in rt.generate(PROMPTS[7], {"max_new_tokens": 400, "ignore_eos": True},
                             stream=True):
        assert chunk["meta_info"]["finish_reason"] is None
        break
    stats = idle(rt)
    assert stats["generated_tokens"] - before < 400
    assert_no_kv_held(stats)
    rt.check_integrity()
    assert_usable(rt)


def test_batched_submits_send_the_blocks_streams_together(rt: Runtime) -> None:
    before = idle(rt)
    passes: list[tuple[str, int]] = []
    rt.set_batch_hook(lambda batch: passes.append((batch.mode.name, batch.size)))
    params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    try:
        with rt.batched_submits():
            streams = [rt.generate(p, params, stream=True) for p in PROMPTS[:4]]
            dropped = rt.generate(PROMPTS[4], {"max_new_tokens": 400, "ignore_eos": True},
                                  stream=True)
            dropped.close()  # its abort precedes its request: it is sent again behind it
            inside = rt.stats()
            assert inside["running"] == inside["waiting"] == 0  # nothing sent yet
            blocking = rt.generate(PROMPTS[5], params)  # a blocking call is never held
            assert len(blocking["output_ids"]) == 3
            held_passes = len(passes)
        outputs = [[chunk for chunk in stream] for stream in streams]
        stats = idle(rt)
    finally:
        rt.set_batch_hook(None)
    assert passes[held_passes][0] == "EXTEND" and passes[held_passes][1] >= 4, passes
    for prompt, chunks in zip(PROMPTS[:4], outputs, strict=True):
        whole = rt.generate(prompt, params)
        assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    assert stats["generated_tokens"] - before["generated_tokens"] < 5 * 3 + 100  # dropped: aborted
    assert_no_kv_held(stats)
    assert_usable(rt)


# ---- errors ----------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty-string": dict(prompt=""),
    "empty-prompt-list": dict(prompt=[]),
    "one-empty-in-batch": dict(prompt=["hello", ""]),
    "empty-input-ids": dict(input_ids=[]),
    "empty-ids-in-batch": dict(input_ids=[[1, 2], []]),
    "both": dict(prompt="hi", input_ids=[1, 2]),
    "neither": dict(),
    "id-past-vocab": dict(input_ids=[1, 49152]),
    "negative-id": dict(input_ids=[1, -1]),
    "non-int-id": dict(input_ids=[1, 2.0]),
    "id-past-vocab-in-the-20th-prompt": dict(input_ids=[[1, 2, 3]] * 19 + [[1, 49152]]),
    "temperature": dict(prompt="hi", sampling_params={"temperature": -1.0}),
    "top-p": dict(prompt="hi", sampling_params={"top_p": 0.0}),
    "unknown-key": dict(prompt="hi", sampling_params={"foo": 1}),
    "n-zero": dict(prompt="hi", sampling_params={"n": 0}),
    "min-over-max": dict(prompt="hi", sampling_params={"min_new_tokens": 5,
                                                       "max_new_tokens": 4}),
    "params-count": dict(prompt=["a", "b"], sampling_params=[{}]),
    "equal-dicts-then-a-bad-one": dict(prompt=["a", "b"], sampling_params=[
        {"stop_token_ids": [16]}, {"stop_token_ids": [16.0]}]),
    "logprob-start": dict(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=3),
    "logprob-start-float": dict(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=0.0),
    "logprob-start-str": dict(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len="0"),
    "top-logprobs-float": dict(prompt="hi", return_logprob=True, top_logprobs_num=2.5),
    "top-logprobs-str": dict(prompt="hi", return_logprob=True, top_logprobs_num="2"),
}


@pytest.mark.parametrize("kwargs", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_invalid_requests(rt: Runtime, kwargs: dict) -> None:
    before = rt.stats()
    with pytest.raises(InvalidRequestError):
        rt.generate(**kwargs)
    after = idle(rt)
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing was submitted
    assert issubclass(InvalidRequestError, ValueError)
    assert_usable(rt)


def test_context_length(model_dir: Path) -> None:
    """A prompt of the context length or more is refused; so is one whose max_new_tokens do not
    fit after it (SGLang's Engine refuses too), naming the numbers; an exact fit and None (up to
    the context) run; `allow_auto_truncate` (SGLang's option) cuts max_new_tokens instead."""
    ignore_eos = {"ignore_eos": True}
    with Runtime(model_dir, max_total_tokens=1024, context_length=64,
                 check_integrity_each_step=True) as small:
        assert small.context_len == 64
        with pytest.raises(InvalidRequestError, match="100 tokens, but this model's maximum "
                                                      "context length is 64 tokens"):
            small.generate(input_ids=list(range(100, 200)))
        with pytest.raises(InvalidRequestError, match="the prompt has 64 tokens"):
            small.generate(input_ids=list(range(100, 164)))
        before = small.stats()["prompt_tokens"]
        with pytest.raises(InvalidRequestError, match=r"maximum context length is 64 tokens\. "
                           r"However, you requested 160 tokens \(60 in the messages, 100 in "
                           r"the completion\)"):
            small.generate(input_ids=list(range(100, 160)),
                           sampling_params={"max_new_tokens": 100, **ignore_eos})
        with pytest.raises(InvalidRequestError, match=r"in the messages, 64 in the completion"):
            small.generate(["fits", "x"], input_ids=None, sampling_params=[
                {"max_new_tokens": 2}, {"max_new_tokens": 64}])  # one bad prompt: none runs
        assert idle(small)["prompt_tokens"] == before  # nothing was submitted
        assert_no_kv_held(small.stats())
        small.check_integrity()
        for limit in (4, None):  # exactly the room; no limit: up to the context
            out = small.generate(input_ids=list(range(100, 160)),
                                 sampling_params={"max_new_tokens": limit, **ignore_eos})
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert_usable(small)
    with Runtime(model_dir, max_total_tokens=1024, context_length=64,
                 allow_auto_truncate=True) as cutting:
        out = cutting.generate(input_ids=list(range(100, 160)),
                               sampling_params={"max_new_tokens": 100, **ignore_eos})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        with pytest.raises(InvalidRequestError, match="the prompt has 64 tokens"):
            cutting.generate(input_ids=list(range(100, 164)))


# ---- threads, aborts, close ------------------------------------------------------------------

def test_concurrent_threads_match_sequential(rt: Runtime) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 16}
    sequential = [rt.generate(p, params)["output_ids"] for p in PROMPTS]
    results: list[list[int] | None] = [None] * len(PROMPTS)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def work(i: int) -> None:
        try:
            barrier.wait()
            results[i] = rt.generate(PROMPTS[i], params)["output_ids"]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=GUARD_S)
    assert not errors, errors
    assert results == sequential
    idle(rt)
    rt.check_integrity()


def test_closing_stream_in_a_thread_aborts(rt: Runtime) -> None:
    received: list[dict] = []
    started = threading.Event()
    stop = threading.Event()

    def consume() -> None:
        stream = rt.generate(PROMPTS[2], {"max_new_tokens": 400, "ignore_eos": True},
                             stream=True)
        for chunk in stream:
            received.append(chunk)
            if len(received) >= 3:
                started.set()
            if stop.is_set():
                stream.close()
                return

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(timeout=GUARD_S)
    stop.set()
    thread.join(timeout=GUARD_S)
    assert not thread.is_alive()
    assert sum(len(c["output_ids"]) for c in received) < 400
    assert all(c["meta_info"]["finish_reason"] is None for c in received)
    stats = idle(rt)
    assert_no_kv_held(stats)
    rt.check_integrity()
    assert_usable(rt)


def test_keyboard_interrupt_aborts_blocking_generate(rt: Runtime, default_sigint) -> None:
    before = rt.stats()["generated_tokens"]

    def interrupt_when_generating() -> None:  # not after a fixed delay: a loaded machine may
        deadline = time.monotonic() + GUARD_S  # not have started the request by then
        while rt.stats()["generated_tokens"] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        _thread.interrupt_main()

    thread = threading.Thread(target=interrupt_when_generating)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        rt.generate(PROMPTS[3], {"max_new_tokens": 400, "ignore_eos": True})
    thread.join()
    stats = idle(rt)
    assert stats["generated_tokens"] - before < 400
    rt.check_integrity()
    assert_usable(rt)


def test_close(model_dir: Path) -> None:
    first = Runtime(model_dir, max_total_tokens=512)
    expected = first.generate(PROMPTS[0], GREEDY)["output_ids"]
    first.close()
    first.close()  # idempotent
    with pytest.raises(RuntimeError):
        first.generate(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError):
        first.stats()

    with Runtime(model_dir, max_total_tokens=512) as second:
        assert second.generate(PROMPTS[0], GREEDY)["output_ids"] == expected
    with pytest.raises(RuntimeError):
        second.generate(PROMPTS[0], GREEDY)


def test_sglang_names_shutdown_and_get_tokenizer(model_dir: Path) -> None:
    runtime = Runtime(model_dir, max_total_tokens=512)
    tokenizer = runtime.get_tokenizer()
    assert tokenizer is runtime.tokenizer
    assert tokenizer.encode("Hello world") == runtime.encode("Hello world")
    runtime.shutdown()  # as close(): refuses new work
    assert runtime.closed
    runtime.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        runtime.generate(PROMPTS[0], GREEDY)


def test_close_aborts_a_running_stream(model_dir: Path) -> None:
    runtime = Runtime(model_dir, max_total_tokens=512)
    stream = runtime.generate(PROMPTS[0], {"max_new_tokens": 400, "ignore_eos": True},
                              stream=True)
    next(stream)
    runtime.close()
    rest = list(stream)  # the stream ends: its request was aborted by close()
    assert rest and rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert sum(len(c["output_ids"]) for c in rest) < 399


# ---- memory pressure and chunking ------------------------------------------------------------

@pytest.mark.parametrize(("shared_prefix", "disable_radix_cache"),
                         [(False, False), (False, True), (True, False)],
                         ids=["radix", "no-cache", "radix-shared-prefix"])
def test_retraction_keeps_outputs(rt: Runtime, model_dir: Path, shared_prefix: bool,
                                  disable_radix_cache: bool) -> None:
    body = "alpha beta gamma delta epsilon " * 3
    prompts = [body + f"Item {i}:" if shared_prefix else f"Item {i}: " + body for i in range(6)]
    lengths = [len(rt.tokenizer.encode(p)) for p in prompts]
    assert all(15 <= n <= 25 for n in lengths), lengths
    params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    alone = [rt.generate(p, params)["output_ids"] for p in prompts]
    # a stop id none of the outputs holds: the requests may stop early as far as admission
    # knows, so it reserves an estimate and the tight pool retracts (see kv_peak.py)
    params["stop_token_ids"] = [min(set(range(1000)) - {t for out in alone for t in out})]
    with Runtime(model_dir, max_total_tokens=160, chunked_prefill_size=32,
                 disable_radix_cache=disable_radix_cache,
                 check_integrity_each_step=True) as tight:
        outs = tight.generate(prompts, params)
        stats = idle(tight)
        assert stats["retractions"] > 0
        assert sum(o["meta_info"]["retractions"] for o in outs) == stats["retractions"]
        assert all(o["meta_info"]["total_retractions"] == o["meta_info"]["retractions"]
                   for o in outs)  # SGLang's name
        assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
                   for o in outs)
        assert [o["output_ids"] for o in outs] == alone
        assert [o["meta_info"]["prompt_tokens"] for o in outs] == lengths
        assert_no_kv_held(stats)
        tight.check_integrity()


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["radix", "no-cache"])
def test_chunked_prefill_matches(rt: Runtime, model_dir: Path,
                                 disable_radix_cache: bool) -> None:
    prompt = " ".join(f"word{i}" for i in range(60))
    ids = rt.tokenizer.encode(prompt)
    assert 120 <= len(ids) <= 200, len(ids)
    params = {"temperature": 0.0, "max_new_tokens": 10}
    whole = rt.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                        logprob_start_len=0)
    with Runtime(model_dir, max_total_tokens=1024, chunked_prefill_size=16,
                 disable_radix_cache=disable_radix_cache,
                 check_integrity_each_step=True) as chunky:
        chunked = chunky.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                  logprob_start_len=0)
        assert chunked["output_ids"] == whole["output_ids"]
        assert chunked["meta_info"]["forward_passes"] >= len(ids) // 16
        a = chunked["meta_info"]["input_token_logprobs"]
        b = whole["meta_info"]["input_token_logprobs"]
        assert len(a) == len(b) == len(ids)
        assert a[0] == b[0] == (None, ids[0])
        assert all(abs(x[0] - y[0]) < 1e-4 and x[1] == y[1]
                   for x, y in zip(a[1:], b[1:], strict=True))
        # several long prompts share the chunk budget
        batch = chunky.generate(input_ids=[ids, ids[:90], ids[:40]], sampling_params=params)
        assert batch[0]["output_ids"] == whole["output_ids"]
        singles = [rt.generate(input_ids=x, sampling_params=params)["output_ids"]
                   for x in (ids[:90], ids[:40])]
        assert [b["output_ids"] for b in batch[1:]] == singles
        chunky.check_integrity()
