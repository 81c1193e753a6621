"""Prompts sent as text: the batch encoding gives the ids of encoding one by one (fast
tokenizers and the slow fallback), chunks are submitted while later ones are encoded, and a bad
prompt in a later chunk aborts the chunks already submitted (no KV leak)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from lmnb.runtime.core import InvalidRequestError
from lmnb.runtime.engine import Runtime
from lmnb.runtime.prompts import (
    FIRST_CHUNK,
    chunk_bounds,
    encode_many,
    ids_in_range,
    split_prompts,
)

TEXTS = [
    "The capital of France is",
    "",
    " ",
    "\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<s> [INST] a </s> <unk> <|endoftext|>",
    "I ❤️ emoji 🦜🤖👩‍💻 and flags 🇫🇷🇯🇵!",
    "你好，世界。日本語のテキスト、한국어",
    "naïve façade e\u0301 Ωμέγα \u200b zero-width",
    "def f(x):\n    return x  *  2\n\t\r\n",
    "   leading and trailing spaces   ",
    "word " * 300,
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=8192,
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def mistral_model_file() -> str:
    mistral_common = pytest.importorskip("mistral_common")
    return os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")


@pytest.fixture(scope="module")
def tokenizers(rt, mistral_model_file, tmp_path_factory) -> dict[str, Any]:
    """SmolLM2's byte-level BPE (fast), Mistral's SentencePiece converted to a fast tokenizer,
    and the same SentencePiece model as a slow (Python) tokenizer."""
    from transformers import LlamaTokenizer, SentencePieceBackend

    folder = tmp_path_factory.mktemp("mistral-v1")
    shutil.copy(mistral_model_file, folder / "tokenizer.model")
    slow = SentencePieceBackend(vocab_file=mistral_model_file, bos_token="<s>",
                                eos_token="</s>", unk_token="<unk>", add_bos_token=True)
    return {"smollm2": rt.tokenizer, "mistral-fast": LlamaTokenizer.from_pretrained(str(folder)),
            "mistral-slow": slow}


def one_by_one(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=True) for text in texts]


@pytest.mark.parametrize("name", ["smollm2", "mistral-fast", "mistral-slow"])
def test_batch_encoding_gives_the_ids_of_one_by_one(tokenizers, name):
    tokenizer = tokenizers[name]
    assert tokenizer.is_fast == (name != "mistral-slow")
    texts = TEXTS * 2  # more than one chunk
    expected = one_by_one(tokenizer, texts)
    assert encode_many(tokenizer, texts) == expected
    prompts = split_prompts(texts, None)
    calls: list[int] = []

    def encode(chunk: Sequence[str]) -> list[list[int]]:
        calls.append(len(chunk))
        return encode_many(tokenizer, chunk)

    chunked = [ids for _, chunk in prompts.chunks(encode, first=4) for ids in chunk]
    assert chunked == expected
    assert calls == [end - start for start, end in chunk_bounds(len(texts), 4)] == [4, 8, 12]


def test_chunks_grow_and_cover_every_prompt_once():
    for count in (1, FIRST_CHUNK, FIRST_CHUNK + 1, 23, 100, 256, 1000):
        bounds = list(chunk_bounds(count))
        assert [start for start, _ in bounds] == [0, *(end for _, end in bounds[:-1])]
        assert bounds[-1][1] == count
        assert bounds[0][1] == min(count, FIRST_CHUNK) or count < 2 * FIRST_CHUNK
        sizes = [end - start for start, end in bounds]
        assert all(b >= a for a, b in zip(sizes, sizes[1:], strict=False))
    assert list(chunk_bounds(256)) == [(0, 8), (8, 24), (24, 56), (56, 120), (120, 256)]


def test_text_batch_matches_ids_with_per_prompt_params(rt):
    texts = [f"Prompt {i}: {TEXTS[i % len(TEXTS)]}" for i in range(40)]
    params = [{**GREEDY, "max_new_tokens": 1 + i % 3, "n": 1 + (i % 5 == 0)}
              for i in range(40)]
    ids = [rt.encode(text) for text in texts]
    by_text = rt.generate(texts, params)
    by_ids = rt.generate(input_ids=ids, sampling_params=params)
    expected_lengths = [p["max_new_tokens"] for p in params for _ in range(p["n"])]
    assert [o["meta_info"]["completion_tokens"] for o in by_text] == expected_lengths
    assert [o["output_ids"] for o in by_text] == [o["output_ids"] for o in by_ids]
    prompt_lengths = [len(i) for i, p in zip(ids, params, strict=True) for _ in range(p["n"])]
    assert [o["meta_info"]["prompt_tokens"] for o in by_text] == prompt_lengths
    rt.check_integrity()


def test_chunks_are_submitted_while_later_ones_are_encoded(rt, monkeypatch):
    events: list[list[Any]] = []  # [kind, count], consecutive submits counted in one
    encode, submit_many = rt._encode_many, rt._scheduler.submit_many

    def recording_encode(texts: Sequence[str]) -> list[list[int]]:
        events.append(["encode", len(texts)])
        return encode(texts)

    def recording_submit_many(states: list[Any]) -> None:  # a chunk's requests: one message
        if events[-1][0] != "submit":
            events.append(["submit", 0])
        events[-1][1] += len(states)
        submit_many(states)

    monkeypatch.setattr(rt, "_encode_many", recording_encode)
    monkeypatch.setattr(rt._scheduler, "submit_many", recording_submit_many)
    outputs = rt.generate([f"Question {i}?" for i in range(60)], GREEDY)
    assert len(outputs) == 60
    bounds = list(chunk_bounds(60))
    assert len(bounds) > 2
    assert events == [event for start, end in bounds
                      for event in (["encode", end - start], ["submit", end - start])]


def _idle(rt: Runtime) -> None:
    rt.check_integrity()  # runs after the aborts on the scheduler thread (one FIFO inbox)
    stats = rt.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.parametrize("bad_index", [3, 45])
def test_a_bad_prompt_aborts_the_submitted_chunks(rt, bad_index, monkeypatch):
    texts = [f"Some question number {i}, answered at length." for i in range(60)]
    texts[bad_index] = ""  # SmolLM2's tokenizer adds no BOS: no tokens at all
    submitted: list[Any] = []
    submit_many = rt._scheduler.submit_many

    def recording_submit_many(states: list[Any]) -> None:
        submitted.extend(states)
        submit_many(states)

    # The scheduler thread waits between steps while generate runs: what generate submitted
    # and aborted is handled in order afterwards, before any step (no race with finishing).
    gate, holding = threading.Event(), threading.Event()
    hold = threading.Thread(target=rt._scheduler.call,
                            args=(lambda: (holding.set(), gate.wait(30)),))
    hold.start()
    assert holding.wait(30)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(rt._scheduler, "submit_many", recording_submit_many)
            with pytest.raises(InvalidRequestError, match="empty prompt"):
                rt.generate(texts, GREEDY)
    finally:
        gate.set()
        hold.join()
    assert (len(submitted) > 0) == (bad_index >= FIRST_CHUNK)
    _idle(rt)
    assert all(state.req.finished_reason["type"] == "abort" for state in submitted)
    texts[bad_index] = "word " * (rt.context_len + 5)
    with pytest.raises(InvalidRequestError,
                       match=rf"maximum context length is {rt.context_len} tokens"):
        rt.generate(texts, GREEDY)
    _idle(rt)
    assert rt.generate(texts[:2], GREEDY)[1]["meta_info"]["completion_tokens"] == 2


def test_a_shared_params_dict_is_checked_per_prompt(rt):
    """One dict for all prompts is parsed once but checked against each prompt: max_new_tokens
    None gives each prompt its own room in the context; a max_new_tokens that one prompt of
    the batch leaves no room for refuses the batch (SGLang's), naming that prompt's numbers,
    and submits nothing."""
    long = "word " * (rt.context_len - 20)
    room = rt.context_len - len(rt.encode(long))
    short_room = rt.context_len - len(rt.encode("Short one."))
    outputs = rt.generate(["Short one.", long], {**GREEDY, "max_new_tokens": None})
    assert [o["meta_info"]["completion_tokens"] for o in outputs] == [short_room, room]
    _idle(rt)
    assert room < 40
    before = rt.stats()["forward_passes"]
    with pytest.raises(InvalidRequestError, match=rf"\({len(rt.encode(long))} in the messages, "
                                                  r"40 in the completion\)"):
        rt.generate(["Short one.", long, "Short two."], {**GREEDY, "max_new_tokens": 40})
    _idle(rt)
    assert rt.stats()["forward_passes"] == before
    outputs = rt.generate(["Short one.", "Short two."], {**GREEDY, "max_new_tokens": 40})
    assert [o["meta_info"]["completion_tokens"] for o in outputs] == [40, 40]


def test_ids_in_range_takes_integers_below_the_vocabulary_only():
    assert ids_in_range([], 10) and ids_in_range([0, 9, True], 10)
    for bad in ([0, 10], [-1, 3], [1, 2.0], [1, "2"], [1, None], [1, 2**70], [[1]]):
        assert not ids_in_range(bad, 10), bad


def test_nested_numpy_integer_ids_are_kept_as_python_ints():
    """NumPy integers (or a 0-d tensor's) pass the range check; they are copied as Python ints,
    so that the outputs' token ids and JSON bodies (a data-parallel replica's, a disk page's
    header) hold ints. Values that are not integers stay for the range check to refuse."""
    import torch

    lists = split_prompts(None, [[np.int64(3), np.int32(4), torch.tensor(5), True], [1, 2.0],
                                 [1, "2"], [np.uint64(2**64 - 1)]]).id_lists
    assert lists[0] == [3, 4, 5, 1] and {type(v) for v in lists[0]} == {int}
    assert [type(v) for v in lists[1]] == [int, float] and lists[2] == [1, "2"]
    assert not any(ids_in_range(ids, 10) for ids in lists[1:])


def test_a_flat_list_of_numpy_integers_is_one_prompt_of_python_ints():
    """As a nested list's: one prompt, its ids Python ints (before: refused as no id list)."""
    prompts = split_prompts(None, list(np.arange(3, 7)))
    assert not prompts.is_batch and prompts.id_lists == [[3, 4, 5, 6]]
    assert {type(v) for v in prompts.id_lists[0]} == {int}


def test_numpy_integer_ids_generate_json_serializable_outputs(rt):
    ids = list(range(300, 340))
    options = dict(sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    plain = rt.generate(input_ids=[ids], **options)
    given = rt.generate(input_ids=[[np.int64(v) for v in ids]], **options)
    assert given[0]["output_ids"] == plain[0]["output_ids"]
    assert [t for _, t in given[0]["meta_info"]["input_token_logprobs"]] == ids
    json.dumps(given)  # every token id a Python int
