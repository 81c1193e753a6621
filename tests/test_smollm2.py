"""The embedded SmolLM2-135M-Instruct gives real answers through the runtime."""

from __future__ import annotations

import pytest

from lmnb.runtime.engine import Runtime

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime():
    with Runtime(max_total_tokens=8192, check_integrity_each_step=True) as rt:
        yield rt


def _chat(rt: Runtime, question: str) -> str:
    return rt.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)


def test_capital_of_france_is_paris(runtime):
    out = runtime.generate(_chat(runtime, "What is the capital of France?"),
                           {"max_new_tokens": 32, "temperature": 0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    runtime.check_integrity()


def test_chat_answer_ends_at_end_of_turn(runtime):
    out = runtime.generate(_chat(runtime, "Say hello."), {"max_new_tokens": 64, "temperature": 0})
    reason = out["meta_info"]["finish_reason"]
    assert reason == {"type": "stop", "matched": runtime.tokenizer.convert_tokens_to_ids(
        "<|im_end|>")}
    assert "<|im_end|>" not in out["text"]


def test_streamed_text_equals_blocking_text(runtime):
    prompt = _chat(runtime, "Name three colors.")
    params = {"max_new_tokens": 24, "temperature": 0}
    whole = runtime.generate(prompt, params)["text"]
    pieces = [chunk["text"] for chunk in runtime.generate(prompt, params, stream=True)]
    assert "".join(pieces) == whole
    assert len([p for p in pieces if p]) > 3
