"""The server's limits, clear errors and accounting, through the real clients (openai, anthropic,
ollama) and httpx: bodies over `max_request_bytes` are 413s before parsing (declared or
chunked), prompts far over the context are refused without tokenizing them whole and leave no
memory behind, a prompt plus its max tokens over the context is a 400 naming the numbers in each
API's shape, non-JSON bodies and images for a text model are clear errors, usage counts a
prompt once whatever `n`, and Anthropic's count_tokens, Ollama's show and ps answer."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from safetensors import safe_open

from lmnb.runtime.engine import Runtime
from lmnb.server import ServerHandle, create_app
from lmnb.server.limits import PROBE_CHARS_PER_TOKEN
from tests import idle

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 4 * 2**20  # the module's server: bodies over 4 MiB are refused
PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
           "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=4096,
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def server(rt) -> Iterator[ServerHandle]:
    with ServerHandle.start(rt, api_key=KEY, served_model_name="tiny",
                            max_request_bytes=LIMIT) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def chat_body(content: str, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **extra}


def chunked(data: bytes, size: int = 65536) -> Iterator[bytes]:
    """A body without Content-Length (httpx sends an iterator chunked)."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def alive(client: openai.OpenAI, rt: Runtime) -> None:
    out = client.completions.create(model="tiny", prompt="still alive", max_tokens=2)
    assert out.choices[0].text is not None
    rt.check_integrity()


# ---- request size ------------------------------------------------------------------------------
def test_bodies_over_the_limit_are_413_declared_or_chunked(client, http, rt):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**chat_body("x" * (LIMIT + 1000)))
    assert caught.value.status_code == 413
    assert f"{LIMIT:,} bytes" in caught.value.message
    big = json.dumps(chat_body("y" * (LIMIT + 1000))).encode()
    response = http.post("/v1/chat/completions", content=chunked(big),
                         headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:  # Anthropic's body and type
        claude.messages.create(**chat_body("z" * (LIMIT + 1000)))
    assert refused.value.status_code == 413 and refused.value.type == "request_too_large"
    assert refused.value.body["type"] == "error"
    small = json.dumps(chat_body("Hello there")).encode()
    response = http.post("/v1/chat/completions", content=chunked(small, size=7),
                         headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]
    assert httpx.post(f"{http.base_url}/v1/chat/completions", content=big).status_code == 401
    alive(client, rt)


def test_prompts_far_over_the_context_are_refused_unread(client, http, rt, monkeypatch):
    encoded: list[int] = []
    encode = rt.encode

    def spy(text: str) -> list[int]:
        encoded.append(len(text))
        return encode(text)

    monkeypatch.setattr(rt, "encode", spy)
    probe = rt.context_len * PROBE_CHARS_PER_TOKEN
    for chars in (probe + 500, 50 * probe, LIMIT - 1000):  # the probe, then the length bound
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**chat_body("hello world " * (chars // 12)))
        assert f"context length is {rt.context_len}" in caught.value.message
    assert encoded and max(encoded) <= probe  # never the whole text
    for body in ({"text": "a b " * probe}, {"text": ["fine", "a b " * 20 * probe]},
                 {"input_ids": [5] * rt.context_len}):
        response = http.post("/generate", json=body)
        assert response.status_code == 400 and "context length" in response.text, body
    monkeypatch.undo()
    alive(client, rt)


def test_memory_comes_back_after_oversized_requests(client, http, rt):
    """20 oversized requests (refused: over the context, over the body limit) leave the
    process's RSS (the server runs in this process) within 200 MB of where it was."""
    process = psutil.Process()
    prompt = chat_body("hello world " * ((LIMIT - 10_000) // 12))
    over = json.dumps(chat_body("z" * (LIMIT + 10_000))).encode()
    headers = {"content-type": "application/json"}
    for _ in range(2):  # warm up: normal requests and each refusal once, small
        alive(client, rt)
        assert http.post("/v1/chat/completions", json=chat_body("a b " * 5000)).status_code == 400
    gc.collect()
    before = process.memory_info().rss
    for i in range(20):
        if i % 2:
            assert http.post("/v1/chat/completions", json=prompt).status_code == 400
        else:
            assert http.post("/v1/chat/completions", content=over,
                             headers=headers).status_code == 413
    gc.collect()
    grown = process.memory_info().rss - before
    assert grown < 200e6, f"RSS grew by {grown / 1e6:.0f} MB"
    alive(client, rt)


# ---- clear errors ------------------------------------------------------------------------------
def test_bodies_that_are_not_json_objects(http):
    for kwargs, got in ((dict(content=b'{"model": "tiny"}',
                              headers={"content-type": "text/plain"}), "'text/plain'"),
                        (dict(data={"model": "tiny"}), "'application/x-www-form-urlencoded'"),
                        (dict(content=b'{"model": "tiny"}'), "no Content-Type")):
        response = http.post("/v1/chat/completions", **kwargs)
        assert response.status_code == 415, kwargs
        message = response.json()["error"]["message"]
        assert "Content-Type: application/json" in message and got in message
    array = http.post("/v1/completions", json=[1, 2])
    assert array.status_code == 400
    assert array.json()["error"]["message"] == "the body must be a JSON object, got an array"
    empty = http.post("/api/chat", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "no body" in empty.json()["error"]  # Ollama's shape


def test_images_for_a_text_model_are_a_clear_400(client, http, rt):
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": PNG_URL}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                "content": content}])
    error = caught.value.body
    assert "takes no images" in error["message"]
    assert error["param"] == "messages.0.content.1"
    chat = http.post("/api/chat", json={"model": "tiny", "stream": False, "messages": [
        {"role": "user", "content": "What is this?", "images": [PNG_URL[22:]]}]})
    assert chat.status_code == 400 and "takes no images" in chat.json()["error"]
    generate = http.post("/api/generate", json={"model": "tiny", "prompt": "What?",
                                                "images": [PNG_URL[22:]], "stream": False})
    assert generate.status_code == 400
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key=KEY, max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG_URL[22:]}}
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        claude.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}])
    with pytest.raises(anthropic.BadRequestError,
                       match=r"messages\.0\.content\.1: this model takes no images"):
        claude.messages.create(model="tiny", max_tokens=2, system="Look.", messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}])
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "Snapshot:"}, block]}
    with pytest.raises(anthropic.BadRequestError,  # Anthropic's indices, whatever `system`
                       match=r"messages\.2\.content\.0\.content\.1: this model takes no images"):
        claude.messages.create(model="tiny", max_tokens=2, system="Look.", messages=[
            {"role": "user", "content": "What is this?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "snap", "input": {}}]},
            {"role": "user", "content": [result]}])
    alive(client, rt)


# ---- accounting --------------------------------------------------------------------------------
def test_usage_counts_a_prompt_once_whatever_n(client, rt):
    prompt = "Counting the usage of one prompt with many choices, fresh text: 4711"
    tokens = len(rt.encode(prompt))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, n=8,
                                      extra_body={"ignore_eos": True})
    assert len(first.choices) == 8 and first.usage.prompt_tokens == tokens
    assert first.usage.completion_tokens == 8 * 2  # completions: every choice's
    assert 0 <= first.usage.prompt_tokens_details.cached_tokens < tokens
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, n=8)
    assert again.usage.prompt_tokens == tokens
    # cached before this request: all of the prompt but the token every request computes
    assert again.usage.prompt_tokens_details.cached_tokens == tokens - 1
    two = client.completions.create(model="tiny", prompt=[prompt, prompt + " and more"],
                                    max_tokens=2, n=3)
    longer = len(rt.encode(prompt + " and more"))
    assert two.usage.prompt_tokens == tokens + longer
    assert two.usage.prompt_tokens_details.cached_tokens <= two.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2, n=6,
        stream=True, stream_options={"include_usage": True})
    usage = [event.usage for event in stream if event.usage][-1]
    chat_tokens = len(rt.encode(rt.apply_chat_template([{"role": "user", "content": prompt}])))
    assert usage.prompt_tokens == chat_tokens
    assert usage.prompt_tokens_details.cached_tokens <= chat_tokens


def test_anthropic_count_tokens_matches_messages_usage(server, rt):
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Count me, please."}]}]
    counted = claude.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Count me, please."}]
    assert counted.input_tokens == len(rt.encode(rt.apply_chat_template(chat)))
    for _ in range(2):  # the second finds the prompt cached
        reply = claude.messages.create(model="tiny", system="Be brief.", messages=messages,
                                       max_tokens=2)
        usage = reply.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert usage.cache_read_input_tokens == counted.input_tokens - 1
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="tiny", messages=[
            {"role": "user", "content": "word " * (rt.context_len * 400)}])


# ---- the context length ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tiny_models) -> Iterator[ServerHandle]:
    """A server over a runtime of a 96-token context: fitting requests run to its end fast."""
    with Runtime(tiny_models["llama-gqa"], max_total_tokens=1024, context_length=96,
                 check_integrity_each_step=True) as runtime, \
            ServerHandle.start(runtime, api_key=KEY, served_model_name="tiny") as handle:
        yield handle


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_the_numbers(small):
    """Every API but Ollama's (`test_ollama_num_ctx_is_the_requests_window`) refuses a request
    whose prompt plus max tokens exceed the context length, as SGLang's and vLLM's servers do
    (lmnb cut max_tokens silently), in its own error shape with the three numbers and before
    anything runs; the runtime stays whole, and a request that fits exactly, or gives no limit
    (up to the context), then runs to the context's end."""
    rt, context = small.runtime, small.runtime.context_len
    client = openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0)
    claude = anthropic.Anthropic(base_url=small.url, api_key=KEY, max_retries=0)
    llama = ollama.Client(host=small.url, headers=AUTH)
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = len(rt.encode(rt.apply_chat_template(messages)))
    room = context - prompt
    numbers = (f"This model's maximum context length is {context} tokens. However, you "
               f"requested {context + 1} tokens ({prompt} in the messages, {room + 1} in the "
               "completion)")
    submitted = rt.stats()["prompt_tokens"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=room + 1,
                                           stream=stream)
        assert caught.value.code == "context_length_exceeded" and numbers in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages,
                                       max_completion_tokens=room + 1, max_tokens=1)
    assert numbers in caught.value.message  # max_completion_tokens is the limit
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[5] * (context - 4), max_tokens=5)
    assert f"({context - 4} in the messages, 5 in the completion)" in caught.value.message
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=60) as http:
        native = http.post("/generate", json={"input_ids": [5] * (context - 4),
                                              "sampling_params": {"max_new_tokens": 5}})
    assert native.status_code == 400
    assert native.json()["error"]["code"] == "context_length_exceeded"
    assert f"({context - 4} in the messages, 5 in the completion)" in native.json()["error"][
        "message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny", messages=messages, max_tokens=room + 1)
    assert refused.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"input length and `max_tokens` exceed context limit: {prompt} + {room + 1} "
                   f"> {context}, decrease input length or `max_tokens` and try again"}}
    stats = idle.wait_idle(rt, 30.0, unlocked=True)
    assert stats["prompt_tokens"] == submitted  # nothing was submitted
    rt.check_integrity()

    to_the_end = {"ignore_eos": True}
    for limit in (room, None):  # exactly the room; no max_tokens: up to the context
        done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=limit,
                                              extra_body=to_the_end)
        assert done.choices[0].finish_reason == "length"
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt, room)
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=60) as http:
        for limit in (4, None):
            out = http.post("/generate", json={"input_ids": [5] * (context - 4),
                                               "sampling_params": {"max_new_tokens": limit,
                                                                   **to_the_end}}).json()
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    fits = claude.messages.create(model="tiny", messages=messages, max_tokens=room)
    assert fits.usage.input_tokens + (fits.usage.cache_read_input_tokens or 0) == prompt
    assert 0 < fits.usage.output_tokens <= room
    assert llama.chat(model="tiny", messages=messages, options={"num_predict": 2}).message
    rt.check_integrity()


def test_ollama_num_ctx_is_the_requests_window(small):
    """Ollama's `options.num_ctx` is the request's window (lmnb ignored it): above the context
    length it is the context length (Ollama clamps it to the trained one); a chat too long for
    it drops its oldest messages but the system ones and the last (server/prompt.go); a prompt
    still too long keeps its first `num_keep` tokens (default 4) and its end, leaving about
    half the rest for the reply (llm/llama_server.go), or is a 400 with `truncate: false`; the
    reply ends at the window's end. `num_predict` past the room is no 400, as in Ollama."""
    rt, context = small.runtime, small.runtime.context_len
    llama = ollama.Client(host=small.url, headers=AUTH)
    text = " ".join(f"w{i}" for i in range(200))
    ids = rt.encode(text)
    bos = int(ids[0] == rt.tokenizer.bos_token_id)
    assert len(ids) > context

    def cut(size: int, keep: int = 4) -> list[int]:
        keep = min(keep + bos, size - 1)
        limit = size - max((size - keep) // 2, 1)
        return ids[:keep] + ids[len(ids) - (limit - keep):]

    def direct(prompt: list[int], size: int) -> str:
        params = {"temperature": 0, "max_new_tokens": size - len(prompt)}
        return rt.generate(None, params, input_ids=prompt)["text"]

    for options, size, keep in (({"num_ctx": 40}, 40, 4), ({"num_ctx": 40, "num_keep": 9}, 40, 9),
                                ({}, context, 4), ({"num_ctx": 10**6}, context, 4)):
        out = llama.generate(model="tiny", prompt=text, raw=True,
                             options={"temperature": 0, "num_predict": 500, **options})
        prompt = cut(size, keep)
        assert out.prompt_eval_count == len(prompt), options
        assert out.response == direct(prompt, size) and out.eval_count <= size - len(prompt)
    *_, last = llama.generate(model="tiny", prompt=text, raw=True, stream=True,
                              options={"temperature": 0, "num_ctx": 40})
    assert last.done and last.prompt_eval_count == len(cut(40))
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=60) as http:
        whole = http.post("/api/generate", json={"model": "tiny", "prompt": text, "raw": True,
                                                 "truncate": False, "stream": False})
    assert (whole.status_code, whole.json()) == (
        400, {"error": "the input length exceeds the context length"})

    system = {"role": "system", "content": "Be brief."}
    old = [{"role": role, "content": " ".join(f"{role}{i}" for i in range(20))}
           for role in ("user", "assistant", "user", "assistant")]
    ask = {"role": "user", "content": "Name a colour."}
    kept = len(rt.encode(rt.apply_chat_template([system, ask])))
    more = len(rt.encode(rt.apply_chat_template([system, *old[-1:], ask])))
    assert kept + 6 < more
    reply = llama.chat(model="tiny", messages=[system, *old, ask],
                       options={"num_ctx": kept + 6, "temperature": 0})
    assert reply.prompt_eval_count == kept and reply.eval_count <= 6
    messages = [{"role": "user", "content": "Name a colour."}]
    room = context - len(rt.encode(rt.apply_chat_template(messages)))
    over = llama.chat(model="tiny", messages=messages, options={"num_predict": room + 1})
    assert over.done and over.eval_count <= room
    rt.check_integrity()


# ---- Ollama's show and ps ----------------------------------------------------------------------
def test_ollama_show_and_ps(server, rt):
    llama = ollama.Client(host=server.url, headers=AUTH)
    shown = llama.show("tiny")
    files = sorted(Path(rt.model_dir).glob("*.safetensors"))
    parameters = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            parameters += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    info, config = shown.modelinfo, rt.model_config
    assert info["general.architecture"] == "llama"
    assert info["general.parameter_count"] == parameters
    assert info["llama.block_count"] == config.num_layers == 2
    assert info["llama.context_length"] == config.max_position_embeddings
    assert info["llama.attention.head_count_kv"] == config.num_kv_heads
    assert shown.details.family == "llama" and shown.details.format == "safetensors"
    assert shown.details.parameter_size == f"{parameters / 1e6:.2f}M"
    assert shown.details.quantization_level == "F32"
    assert shown.capabilities == ["completion", "tools"] and "im_start" in shown.template
    assert llama.show("tiny:latest").details == shown.details
    with pytest.raises(ollama.ResponseError) as caught:
        llama.show("llama3")
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    (loaded,) = llama.ps().models
    assert loaded.name == loaded.model == "tiny"
    assert loaded.context_length == rt.context_len
    memory = rt.stats()["memory"]
    assert loaded.size == int((memory["weights_gb"] + memory["kv_gb"]) * 2**30) > 0
    assert loaded.size_vram == (loaded.size if rt.device.type == "cuda" else 0)
    assert loaded.details == shown.details and loaded.expires_at.year == 9999
    (listed,) = llama.list().models
    assert listed.size == sum(file.stat().st_size for file in files)


def test_ollama_list_and_ps_name_the_model_by_a_sha256_digest(server, rt, tmp_path):
    """/api/tags and /api/ps give the model's `digest` as Ollama's: 64 hex digits (its CLI
    prints `digest[:12]` in `ollama list` and `ollama ps`, which an empty one, lmnb's, makes
    panic). It stands for the served files: their headers, sizes and modification times (not
    a hash of the weights, which would take minutes for a 7B), so it changes when they do."""
    from lmnb.server.ollama import Checkpoint

    llama = ollama.Client(host=server.url, headers=AUTH)
    ((listed,), (loaded,)) = llama.list().models, llama.ps().models
    assert re.fullmatch(r"[0-9a-f]{64}", listed.digest)
    assert loaded.digest == listed.digest == Checkpoint.read(rt.model_dir).digest
    copy = tmp_path / "copy"
    shutil.copytree(rt.model_dir, copy)
    before = Checkpoint.read(copy).digest
    (weights, *_) = sorted(copy.glob("*.safetensors"))
    os.utime(weights, ns=(0, 0))
    assert Checkpoint.read(copy).digest != before


# ---- options -----------------------------------------------------------------------------------
def test_max_request_bytes_options(rt):
    from lmnb.__main__ import build_parser
    from lmnb.magics.parsing import lmnb_parser

    assert build_parser().parse_args(["serve"]).max_request_bytes == 32 * 2**20
    assert build_parser().parse_args(["serve", "--max-request-bytes", "1000"]
                                     ).max_request_bytes == 1000
    assert lmnb_parser().parse_args(["serve", "--max-request-bytes", "1000"]
                                    ).max_request_bytes == 1000
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(rt, max_request_bytes=0)
    with ServerHandle.start(rt, max_request_bytes=100) as handle:
        assert httpx.post(f"{handle.url}/v1/completions", json={"prompt": "x" * 200}
                          ).status_code == 413
        assert httpx.post(f"{handle.url}/v1/completions", json={"prompt": "x",
                                                                "max_tokens": 1}
                          ).status_code == 200
