"""The HTTP server over a live Runtime, started on a free loopback port and driven by the official
`openai` client and httpx: OpenAI, SGLang-native, Anthropic and Ollama shapes, errors, auth,
disconnects and many concurrent streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterator
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel

from lmnb.runtime.engine import Runtime
from lmnb.server import ServerHandle
from tests import idle
from tests.pass_gate import PassGate, gated_passes

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=8192,
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def server(rt) -> Iterator[ServerHandle]:
    with ServerHandle.start(rt, api_key=KEY, served_model_name="tiny") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def wait_idle(rt: Runtime) -> dict:
    """Idle with no cache lock held (tests/idle.py), within 30 s."""
    return idle.wait_idle(rt, 30.0, unlocked=True)


def sse_data(lines: Iterator[str]) -> list:
    """The JSON payloads of an SSE body, up to `[DONE]` (which must come)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return out
        out.append(json.loads(data))
    raise AssertionError("the stream ended without data: [DONE]")


# ---- OpenAI ------------------------------------------------------------------------------------
def test_models_and_chat_completion(client, rt):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    chat = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                          max_tokens=8, seed=1)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    prompt = rt.apply_chat_template(CHAT)
    direct = rt.generate(prompt, {"temperature": 0, "max_new_tokens": 8})
    assert choice.message.content == direct["text"]
    assert chat.usage.completion_tokens == direct["meta_info"]["completion_tokens"]
    assert chat.usage.prompt_tokens == len(rt.encode(prompt))
    again = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                           max_tokens=8)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran before
    assert choice.finish_reason in ("stop", "length")


def test_completion_n_and_stop(client, rt):
    out = client.completions.create(model="tiny", prompt=["Hello", "The sky"], max_tokens=6,
                                    temperature=0.8, n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 6
    assert out.usage.prompt_tokens == len(rt.encode("Hello")) + len(rt.encode("The sky"))
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                       temperature=0)
    text = greedy.choices[0].text
    assert len(text) > 2
    stop = text[1:3]
    cut = client.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_echo_repeats_the_prompt_with_its_logprobs(client, rt):
    """`echo` (with integer `logprobs`), as vLLM and SGLang serve it: the prompt before the
    completion, its tokens' logprobs first (the first one null); it was a 400."""
    prompt = "The sky is blue and"
    direct = rt.generate(prompt, {"temperature": 0, "max_new_tokens": 3}, return_logprob=True,
                         logprob_start_len=0, top_logprobs_num=1)
    meta = direct["meta_info"]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt + direct["text"]
    pairs = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert len(choice.logprobs.tokens) == out.usage.prompt_tokens + 3 == len(pairs)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp for lp, _ in pairs[1:]],
                                                               abs=1e-4)
    assert "".join(choice.logprobs.tokens) == choice.text
    ids = rt.encode(prompt)
    by_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=3,
                                       temperature=0, echo=True)
    assert [c.text for c in by_ids.choices] == [rt.tokenizer.decode(ids) + direct["text"]] * 2
    streamed = client.completions.create(model="tiny", prompt=[prompt, "Hi"], max_tokens=3,
                                         temperature=0, echo=True, n=2, stream=True)
    texts: dict[int, str] = {}
    for event in streamed:
        for c in event.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == texts[1] == prompt + direct["text"] and texts[2].startswith("Hi")
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == prompt


def test_streaming_chat_equals_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                           max_tokens=10)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                            max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    events = list(stream)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    assert events[0].choices[0].delta.role == "assistant"
    finishes = [e.choices[0].finish_reason for e in events if e.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == (
        whole.usage.completion_tokens)


def test_streaming_completion(client):
    stream = client.completions.create(model="tiny", prompt="Once", max_tokens=7,
                                       temperature=0, stream=True)
    chunks = list(stream)
    whole = client.completions.create(model="tiny", prompt="Once", max_tokens=7, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def running_usage(events: list) -> dict[int, list]:
    """Per choice index, the `usage` of each of its chunks that carries text
    (`continuous_usage_stats`)."""
    usages: dict[int, list] = {}
    for event in events:
        for choice in event.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            if text:
                usages.setdefault(choice.index, []).append(event.usage)
    return usages


def test_continuous_usage_stats_count_each_choice_so_far(client, rt):
    """`stream_options.continuous_usage_stats` (SGLang's and vLLM's): every chunk has the usage
    of its choice so far; it was ignored (no usage before the final chunk)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, n=2, stream=True, stream_options=options,
        extra_body={"ignore_eos": True}))
    text = list(client.completions.create(
        model="tiny", prompt="Once", max_tokens=5, n=2, stream=True, stream_options=options,
        extra_body={"ignore_eos": True}))
    prompts = {"chat": len(rt.encode(rt.apply_chat_template(CHAT))),
               "text": len(rt.encode("Once"))}
    for kind, events in (("chat", chat), ("text", text)):
        assert all(e.usage is not None for e in events), kind
        usages = running_usage(events)
        assert sorted(usages) == [0, 1], kind
        for usage in usages.values():
            counts = [u.completion_tokens for u in usage]
            # each chunk with text brings at least one new token
            assert all(count >= k for k, count in enumerate(counts, 1)), (kind, counts)
            assert counts == sorted(counts) and counts[-1] <= 5, (kind, counts)
            assert {u.prompt_tokens for u in usage} == {prompts[kind]}
            assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usage)
        finals = [e.usage.completion_tokens for e in events
                  if e.choices and e.choices[0].finish_reason]
        assert finals == [5, 5], kind
        assert events[-1].choices == [] and events[-1].usage.completion_tokens == 10
    plain = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                                stream=True))
    assert all(e.usage is None for e in plain)


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"],
        "additionalProperties": False}
    for seed in (0, 1):
        out = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=80, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    regex = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                           extra_body={"regex": "(yes|no)!"})
    assert regex.choices[0].message.content in ("yes!", "no!")


def test_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)
        assert token.bytes == list(token.token.encode())
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_streamed_logprobs_cover_every_token(client):
    events = list(client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
        stream=True, extra_body={"ignore_eos": True}))
    content = [t for e in events if e.choices and e.choices[0].logprobs
               for t in e.choices[0].logprobs.content]
    assert len(content) == 6


def test_streamed_logprobs_come_with_their_own_chunks(client):
    """A streamed chunk carries the logprobs of its own tokens, as vLLM's and SGLang's do (they
    all came in the last chunk, after the text): each chunk's tokens spell its text, and all
    of them are the whole response's."""
    kwargs = dict(model="tiny", temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    chat = dict(kwargs, messages=CHAT, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    events = [e.choices[0] for e in client.chat.completions.create(**chat, stream=True)
              if e.choices]
    texts = [c for c in events if c.delta.content]
    assert len(texts) > 1
    for choice in texts:
        assert "".join(t.token for t in choice.logprobs.content) == choice.delta.content
    streamed = [t for c in events if c.logprobs for t in c.logprobs.content]
    assert [(t.token, len(t.top_logprobs)) for t in streamed] == [
        (t.token, len(t.top_logprobs)) for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)

    text = dict(kwargs, prompt="Once", logprobs=1)
    whole_text = client.completions.create(**text).choices[0].logprobs
    pieces = [c.choices[0] for c in client.completions.create(**text, stream=True)]
    assert len([p for p in pieces if p.text]) > 1
    for piece in pieces:
        assert "".join(piece.logprobs.tokens) == piece.text
    assert [t for p in pieces for t in p.logprobs.tokens] == whole_text.tokens
    assert [o for p in pieces for o in p.logprobs.text_offset] == whole_text.text_offset


class RecordingRuntime:
    """`rt` served as it is, each `generate` call's keyword arguments kept in `calls`."""

    def __init__(self, rt: Runtime) -> None:
        self.rt, self.tokenizer, self.calls = rt, rt.tokenizer, []
        self.context_len, self.max_total_tokens = rt.context_len, rt.max_total_tokens
        self.model_config, self.engine_config = rt.model_config, rt.engine_config
        self.model_dir = rt.model_dir

    def generate(self, prompt=None, sampling_params=None, **kwargs):
        self.calls.append(kwargs)
        return self.rt.generate(prompt, sampling_params, **kwargs)

    def apply_chat_template(self, messages, add_generation_prompt=True, *, tools=None,
                            template_kwargs=None):
        return self.rt.apply_chat_template(messages, add_generation_prompt, tools=tools,
                                           template_kwargs=template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.rt.encode(text)

    def stats(self) -> dict:
        return self.rt.stats()

    def flush_cache(self) -> bool:
        return self.rt.flush_cache()


def test_streamed_logprobs_do_not_ask_for_token_origins(rt):
    """The runtime's running chunks of a logprob request carry their tokens' logprobs: streamed
    OpenAI and Ollama logprobs ask for `return_logprob` alone, not for origin tracking, and
    still come a chunk at a time."""
    recording = RecordingRuntime(rt)
    with ServerHandle.start(recording, served_model_name="tiny") as handle:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)
        kwargs = dict(model="tiny", temperature=0, max_tokens=6, stream=True,
                      extra_body={"ignore_eos": True})
        chat = [e.choices[0] for e in client.chat.completions.create(
            **kwargs, messages=CHAT, logprobs=True, top_logprobs=2) if e.choices]
        text = [e.choices[0] for e in client.completions.create(**kwargs, prompt="Once",
                                                                logprobs=1)]
        llama = list(ollama.Client(host=handle.url).chat(
            model="tiny", messages=CHAT, stream=True, logprobs=True, top_logprobs=2,
            options={"temperature": 0, "num_predict": 6}))
    assert len(recording.calls) == 3
    for call in recording.calls:
        assert call["return_logprob"] and not call.get("return_token_origins")
    assert len([c for c in chat if c.logprobs and c.logprobs.content]) > 1
    assert len([p for p in text if p.logprobs and p.logprobs.tokens]) > 1
    assert len([r for r in llama if r.logprobs]) > 1
    assert sum(len(c.logprobs.content) for c in chat if c.logprobs) == 6


def test_chat_logprob_bytes_rebuild_a_character_split_over_tokens(client, rt):
    """`bytes` are each token's own: the tokens spelling one character (an emoji is three
    byte-level tokens) each decode alone to U+FFFD, but their bytes concatenated are it."""
    assert len(rt.tokenizer.encode("🦒", add_special_tokens=False)) > 1
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10,
                                         logprobs=True, extra_body={"regex": "🦒"})
    choice = out.choices[0]
    assert choice.message.content == "🦒"
    raw = bytes(b for token in choice.logprobs.content for b in token.bytes)
    assert raw.decode("utf-8") == "🦒", raw


def test_developer_role_is_accepted_as_the_system_prompt(client):
    """OpenAI's `developer` role replaces `system` (newer models, agent frameworks)."""
    system = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_tokens=5, temperature=0)
    developer = client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "Be brief."}, *CHAT],
        max_tokens=5, temperature=0)
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


def test_null_means_not_given_for_every_field(client):
    """OpenAI's and vLLM's request fields are nullable: `"n": null`, `"stream": null`,
    `"logprobs": null`, `"echo": null` (the `openai` client sends them for `n=None`, ...) are
    their defaults; they were 400s ("Input should be a valid integer")."""
    given = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                           temperature=0)
    nulls = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                           temperature=0, n=None, stream=None, logprobs=None,
                                           stop=None, stream_options=None)
    assert nulls.choices[0].message.content == given.choices[0].message.content
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None
    text = client.completions.create(model="tiny", prompt="Once", max_tokens=None,
                                     temperature=0, n=None, stream=None, echo=None,
                                     logprobs=None)
    assert len(text.choices) == 1 and text.usage.completion_tokens <= 16  # max_tokens' default


def test_chat_continues_a_final_assistant_message_as_vllm_does(client, rt):
    """vLLM's and SGLang's `continue_final_message` / `add_generation_prompt` (what
    `lmnb.OpenAI(..., continue_final_message=True)` sends): the reply continues the last
    assistant message, or the prompt ends without an assistant opening; both were ignored (a
    new assistant turn after the given one)."""
    prefix = "My favourite colour is"
    messages = [*CHAT, {"role": "assistant", "content": prefix}]
    continued = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = rt.apply_chat_template(CHAT) + prefix
    direct = rt.generate(prompt, {"temperature": 0, "max_new_tokens": 6})
    assert continued.choices[0].message.content == direct["text"]
    assert continued.usage.prompt_tokens == len(rt.encode(prompt))
    bare = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(rt.encode(
        rt.apply_chat_template(CHAT, add_generation_prompt=False)))
    for extra, msgs in (({"continue_final_message": True, "add_generation_prompt": True},
                         messages),
                        ({"continue_final_message": True}, CHAT)):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                           extra_body=extra)
        assert info.value.body["param"] in ("continue_final_message", "messages"), extra


def test_choices_name_the_stop_that_ended_them(client):
    """SGLang's `matched_stop` on each finished choice (what `lmnb.OpenAI` reads into a gen's
    finish_reason): the stop string or token id, null at the length limit; it was absent."""
    text = client.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = text[1:3]
    cut = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                    stop=["zzz", stop])
    assert cut.choices[0].model_extra["matched_stop"] == stop
    streamed = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                              temperature=0, stop=stop, stream=True))
    assert streamed[-1].choices[0].model_extra["matched_stop"] == stop
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].model_extra["matched_stop"] is None
    word = whole.choices[0].message.content[2:5]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6,
                                          temperature=0, stop=[word])
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].model_extra["matched_stop"] == word
    events = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6,
                                                 temperature=0, stop=[word], stream=True))
    assert events[-1].choices[0].model_extra["matched_stop"] == word


def test_unserved_openai_endpoints_say_so(client):
    """`/v1/embeddings` (a generative model: a 400, as vLLM's for such a model) and
    `/v1/responses` (lmnb serves Chat Completions) answer in words; they were bare 404s
    ("Not Found")."""
    with pytest.raises(openai.BadRequestError, match="embeddings") as info:
        client.embeddings.create(model="tiny", input="hello")
    assert info.value.body["code"] == "unsupported_endpoint"
    with pytest.raises(openai.NotFoundError, match="/v1/chat/completions") as info:
        client.responses.create(model="tiny", input="hello")
    assert info.value.body["code"] == "unsupported_endpoint"


def test_responses_carry_an_x_request_id(server, client):
    """Every response has OpenAI's `x-request-id` header (the `openai` client keeps it as
    `_request_id` and in its errors): the client's own `X-Request-Id` echoed, as vLLM's
    `--enable-request-id-headers` does, or a new one; there was none."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT,
                                                           max_tokens=2)
    made = raw.headers["x-request-id"]
    assert made.startswith("req_") and raw.parse()._request_id == made
    again = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT,
                                                             max_tokens=2)
    assert again.headers["x-request-id"] != made
    mine = {"X-Request-Id": "trace-42"}
    with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=CHAT, max_tokens=2, stream=True, extra_headers=mine) as sse:
        assert sse.headers["x-request-id"] == "trace-42"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[], extra_headers=mine)
    assert info.value.request_id == "trace-42"
    assert httpx.get(f"{server.url}/v1/models").headers["x-request-id"].startswith("req_")


def test_an_assistant_refusal_part_is_its_text(client):
    """OpenAI lets an assistant message carry `refusal` content parts (a history with a refusal
    sent back); they are that turn's text, as vLLM reads them; they were a 400."""
    said = "I cannot help with that."
    history = [*CHAT, None, {"role": "user", "content": "Name a fruit."}]
    replies = []
    for content in ([{"type": "refusal", "refusal": said}], said):
        history[1] = {"role": "assistant", "content": content}
        replies.append(client.chat.completions.create(model="tiny", messages=history,
                                                      max_tokens=4, temperature=0))
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="refusal"):
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": said}]}])


def test_chat_template_kwargs_reach_the_template(client, rt, monkeypatch):
    """SGLang's and vLLM's `chat_template_kwargs` (e.g. Qwen3's `enable_thinking`) are
    variables of the chat template; they were dropped. A name that is one of the renderer's
    own arguments (`tokenize`, ...) is a 400 naming the field."""
    template = rt.tokenizer.chat_template
    monkeypatch.setattr(rt.tokenizer, "chat_template",
                        "{% if greeting %}{{ greeting }}\n{% endif %}" + template)
    plain = rt.apply_chat_template(CHAT)
    greeted = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=1,
        extra_body={"chat_template_kwargs": {"greeting": "Ahoy there, matey"}})
    assert greeted.usage.prompt_tokens == len(rt.encode("Ahoy there, matey\n" + plain))
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1
                                          ).usage.prompt_tokens == len(rt.encode(plain))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_completion_best_of_returns_the_likeliest_candidates(client):
    """OpenAI's `best_of`: `best_of` candidates per prompt generated, the `n` with the highest
    log probability per token returned (all billed); it was ignored (one sample, n tokens)."""
    kwargs = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 1.0,
              "seed": 11, "extra_body": {"ignore_eos": True}}
    every = client.completions.create(n=4, logprobs=0, **kwargs).choices
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every]
    ranked = [c.text for _, c in sorted(zip(means, every, strict=True), key=lambda p: -p[0])]
    best = client.completions.create(best_of=4, **kwargs)
    assert [c.text for c in best.choices] == ranked[:1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 4 * 5
    two = client.completions.create(best_of=4, n=2, logprobs=1, **kwargs)
    assert [c.text for c in two.choices] == ranked[:2] and [c.index for c in two.choices] == [0, 1]
    assert len(two.choices[0].logprobs.tokens) == 5
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(best_of=1, n=2, **kwargs)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(best_of=3, stream=True, **kwargs)


# ---- errors and auth ---------------------------------------------------------------------------
def test_api_key_required_except_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    for path in ("/v1/models", "/get_model_info"):
        response = httpx.get(f"{server.url}{path}")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_browsers_may_call_every_route_cors(server, client, rt):
    """CORS as SGLang's and vLLM's servers (Starlette's `CORSMiddleware`, every origin, method
    and header): a browser's preflight is answered without the key, and responses (a 401 too)
    carry `access-control-allow-origin`; there was none (a notebook's JS could not call the
    server). `allowed_origins` narrows it, empty turns it off."""
    origin = {"Origin": "http://localhost:8888"}
    for path in ("/v1/chat/completions", "/generate", "/v1/messages", "/api/chat"):
        preflight = httpx.options(f"{server.url}{path}", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"})
        assert preflight.status_code == 200, (path, preflight.text)
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT, max_tokens=2, extra_headers=origin)
    assert raw.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(f"{server.url}/v1/models", headers=origin)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    with ServerHandle.start(rt, allowed_origins=["http://localhost:8888"]) as narrow, \
            ServerHandle.start(rt, allowed_origins=[]) as closed:
        assert httpx.get(f"{narrow.url}/v1/models", headers=origin).headers[
            "access-control-allow-origin"] == "http://localhost:8888"
        other = httpx.get(f"{narrow.url}/v1/models", headers={"Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers
        assert "access-control-allow-origin" not in httpx.get(
            f"{closed.url}/v1/models", headers=origin).headers


def test_bad_requests_are_400_and_runtime_stays_usable(http, client, rt):
    bad_json = http.post("/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
    missing = http.post("/v1/chat/completions", json={"model": "tiny"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    for body in ({"messages": CHAT, "temperature": -1},
                 {"messages": [{"role": "wizard", "content": "hi"}]},
                 {"messages": CHAT, "regex": "(unclosed"},
                 {"messages": CHAT, "top_p": 0}):
        response = http.post("/v1/chat/completions", json={"model": "tiny", **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="seed must be in"):  # torch cannot take it
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, seed=2**64)
    assert http.post("/generate", json={"text": "x", "sampling_params": {"nope": 1}}
                     ).status_code == 400
    assert http.post("/generate", json={"sampling_params": {}}).status_code == 400
    reasoning = http.post("/generate", json={"text": "x", "require_reasoning": True})
    assert reasoning.status_code == 400
    assert reasoning.json()["error"]["param"] == "require_reasoning"
    for name, value in (("lora_path", "adapter"), ("return_hidden_states", True),
                        ("input_embeds", [[0.5, 0.25]]), ("audio_data", "a.wav"),
                        ("custom_logit_processor", "{}"), ("session_params", {"id": "s"}),
                        ("return_hidden_states", [False, True])):
        refused = http.post("/generate", json={"text": "x", name: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, name
    defaults = {"lora_path": None, "return_hidden_states": [False], "return_entropy": False}
    assert http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1},
                                        **defaults}).status_code == 200
    out = client.completions.create(model="tiny", prompt="still alive", max_tokens=3)
    assert out.choices[0].text is not None
    wait_idle(rt)
    rt.check_integrity()


def test_bad_logprob_counts_are_400s_that_name_their_parameter(client):
    """`top_logprobs` without `logprobs: true` is refused as vLLM refuses it (it was ignored:
    no logprobs came back), and a negative count names the client's parameter (it named
    lmnb's `top_logprobs_num`, with no `param`)."""
    cases = [(client.chat.completions.create, {"messages": CHAT, "top_logprobs": 2},
              "top_logprobs"),
             (client.chat.completions.create,
              {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
             (client.completions.create, {"prompt": "Hi", "logprobs": -1}, "logprobs")]
    for create, kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            create(model="tiny", max_tokens=2, **kwargs)
        assert error.value.param == param and "top_logprobs_num" not in error.value.message
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                         top_logprobs=0)
    assert out.choices[0].logprobs is None


def test_logprob_counts_over_twenty_are_400s(client):
    """Chat's `top_logprobs` is 0..20 (OpenAI's bound) and completions' `logprobs` 0..20
    (vLLM's `max_logprobs`; OpenAI's is 5); both were unbounded (a 21st alternative came
    back)."""
    for create, kwargs, param in (
            (client.chat.completions.create,
             {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            (client.completions.create, {"prompt": "Hi", "logprobs": 21}, "logprobs")):
        with pytest.raises(openai.BadRequestError, match="20") as error:
            create(model="tiny", max_tokens=2, **kwargs)
        assert error.value.param == param
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                          logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in chat.choices[0].logprobs.content)
    text = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=20,
                                     temperature=0)
    assert all(5 < len(top) <= 20 for top in text.choices[0].logprobs.top_logprobs)


def test_stream_options_need_stream(client):
    """`stream_options` without `stream: true` is a 400 naming it, as OpenAI's API and vLLM
    answer; it was ignored. vLLM refuses any non-empty object (even `{"include_usage": false}`)
    and accepts an empty one, as SGLang accepts them all: `{}` is not a 400 (it was). Null is
    not given."""
    for create, kwargs in ((client.chat.completions.create, {"messages": CHAT}),
                           (client.completions.create, {"prompt": "Hi"})):
        for stream in (False, None):
            for options in ({"include_usage": True}, {"include_usage": False},
                            {"continuous_usage_stats": False}):
                with pytest.raises(openai.BadRequestError, match="stream=True") as error:
                    create(model="tiny", max_tokens=2, stream=stream, stream_options=options,
                           **kwargs)
                assert error.value.param == "stream_options"
            assert create(model="tiny", max_tokens=2, stream=stream, stream_options={},
                          **kwargs).choices
        assert create(model="tiny", max_tokens=2, stream_options={}, **kwargs).choices
        assert create(model="tiny", max_tokens=2, stream_options=None, **kwargs).choices


def test_logit_bias_forces_and_bans_greedy_tokens(client, rt):
    """OpenAI's `logit_bias` (string ids, as the client sends them): +100 makes greedy chat and
    completion output that token, -100 bans the token greedy decoding picks without it (the
    same request without a bias is unchanged afterwards), and a streamed chat is the same."""
    blue = rt.encode(" blue")[-1]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                          temperature=0, logit_bias={str(blue): 100})
    assert chat.choices[0].message.content == rt.tokenizer.decode([blue] * 3)
    streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                              temperature=0, logit_bias={str(blue): 100},
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        chat.choices[0].message.content
    prompt = rt.encode("The sky is")
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    plain = rt.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True})
    before = client.completions.create(**kwargs).choices[0].text
    banned = client.completions.create(**kwargs, logit_bias={str(plain[0]): -100})
    assert before == rt.tokenizer.decode(plain)
    ids = rt.generate(input_ids=prompt, sampling_params={
        **greedy, "logit_bias": {plain[0]: -100.0}})["output_ids"]
    assert ids[0] != plain[0] and banned.choices[0].text == rt.tokenizer.decode(ids) != before
    assert client.completions.create(**kwargs).choices[0].text == before
    wait_idle(rt)
    rt.check_integrity()


def test_native_generate_logit_bias_in_a_batch_leaves_the_others_unchanged(http, rt):
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    texts = ["Hello", "The sky is", "Once upon"]
    alone = [http.post("/generate", json={"text": t, "sampling_params": params}).json()
             for t in texts]
    blue = rt.encode(" blue")[-1]
    batch = http.post("/generate", json={"text": texts, "sampling_params": [
        params, {**params, "logit_bias": {str(blue): 100.0}}, params]}).json()
    assert batch[1]["output_ids"] == [blue] * 5
    assert [batch[0]["output_ids"], batch[2]["output_ids"]] == \
        [alone[0]["output_ids"], alone[2]["output_ids"]]


def test_bad_logit_bias_is_a_400_naming_it(client, http, rt):
    vocab = rt.model_config.vocab_size
    for bias, words in (({str(vocab): 5}, "not in the vocabulary"), ({"-3": 5}, "vocabulary"),
                        ({"blue": 5}, "keys must be token ids"),
                        ({"5": "much"}, "logit_bias")):
        for create, kwargs in ((client.chat.completions.create, {"messages": CHAT}),
                               (client.completions.create, {"prompt": "Hi"})):
            with pytest.raises(openai.BadRequestError, match=words) as error:
                create(model="tiny", max_tokens=2, logit_bias=bias, **kwargs)
            assert error.value.param == "logit_bias", bias
    nan = http.post("/v1/completions", content=b'{"prompt": "Hi", "logit_bias": {"5": NaN}}',
                    headers={"content-type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "logit_bias"
    native = http.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 2, "logit_bias": {str(vocab + 7): 1.0}}})
    assert native.status_code == 400 and "logit_bias" in native.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text \
        is not None


def test_disconnect_mid_stream_frees_kv(server, rt):
    """Dropped clients abort their requests: far fewer tokens are generated than asked for,
    and every KV slot and lock comes back."""
    samples, tokens = 12, 400
    before = wait_idle(rt)["generated_tokens"]
    body = {"model": "tiny", "messages": CHAT, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "n": samples}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 2 * samples:
                    break
    stats = wait_idle(rt)
    assert stats["generated_tokens"] - before < samples * tokens
    rt.check_integrity()
    # a non-streaming request dropped by its client is aborted too
    before = stats["generated_tokens"]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json={"text": "long", "sampling_params": {
                "max_new_tokens": tokens, "ignore_eos": True, "n": samples}})
    stats = wait_idle(rt)
    assert stats["generated_tokens"] - before < samples * tokens
    rt.check_integrity()


def test_a_failure_building_a_response_aborts_its_requests(client, rt, monkeypatch):
    """The requests of a completion whose response fails after they were submitted (here its
    echoed prompt text is refused) are aborted, not left generating with nobody reading. (A
    refusal rather than a crash: uvicorn drops the connection after an unhandled error.)"""
    from lmnb.server import openai_api
    from lmnb.server.errors import APIError

    def refuse(*args: object) -> list[str]:
        raise APIError("this prompt cannot be echoed", param="echo")

    monkeypatch.setattr(openai_api, "_echoed", refuse)
    samples, tokens = 8, 400
    before = wait_idle(rt)["generated_tokens"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="cannot be echoed"):
            client.completions.create(model="tiny", prompt="Hi", echo=True, n=samples,
                                      max_tokens=tokens, stream=stream,
                                      extra_body={"ignore_eos": True})
        stats = wait_idle(rt)
        assert stats["generated_tokens"] - before < samples * tokens
        rt.check_integrity()
        before = stats["generated_tokens"]


def post_scope(path: str, data: bytes) -> dict:
    """The ASGI scope of a JSON POST of `data` to `path`, as uvicorn sends it (spec 2.3)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(data)).encode())]}


async def write_blocked_then_gone(app, path: str, body: dict) -> None:
    """Serves a POST of `body` to `path` as uvicorn does (ASGI spec 2.3) to a client that
    stops reading, then leaves: the first body write never drains, and the disconnect comes
    while it waits (Starlette cancels the body task inside `send`)."""
    data = json.dumps(body).encode()
    scope = post_scope(path, data)
    gone = asyncio.Event()
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            gone.set()
            await asyncio.Event().wait()

    await app(scope, receive, send)


@pytest.fixture()
def kept_responses(monkeypatch) -> list:
    """Every streamed response made while the test runs, kept alive (as a reference cycle
    would keep one until the garbage collector runs)."""
    from starlette.responses import StreamingResponse

    kept = []
    init = StreamingResponse.__init__

    def keep(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        kept.append(self)

    monkeypatch.setattr(StreamingResponse, "__init__", keep)
    return kept


def test_a_streamed_body_cancelled_mid_write_aborts_its_requests(rt, kept_responses):
    """A client that stops reading, then leaves, cancels its streamed body while a write waits:
    the event generator is left suspended at a `yield`, unclosed. Its requests are aborted when
    the request ends, not when (if ever) the garbage collector finalizes the generator."""
    from lmnb.server import create_app

    samples, tokens = 8, 400
    body = {"model": "tiny", "messages": CHAT, "max_tokens": tokens, "n": samples,
            "ignore_eos": True, "stream": True}

    async def serve() -> dict:
        await write_blocked_then_gone(create_app(rt), "/v1/chat/completions", body)
        return await asyncio.to_thread(wait_idle, rt)

    before = wait_idle(rt)["generated_tokens"]
    stats = asyncio.run(serve())
    assert kept_responses, "the route did not answer with a stream"
    assert stats["generated_tokens"] - before < samples * tokens
    rt.check_integrity()


def test_a_rid_is_free_once_its_stream_was_cancelled_mid_write(rt, kept_responses):
    """The `rid` of a streamed `/generate` cancelled mid-write names no running request once
    the request ended: a new request may take it (SGLang refuses only a rid in flight)."""
    from lmnb.server import create_app

    app = create_app(rt)
    params = {"max_new_tokens": 400, "ignore_eos": True}

    async def serve() -> httpx.Response:
        await write_blocked_then_gone(app, "/generate", {"text": "Hi", "rid": "again",
                                                         "stream": True,
                                                         "sampling_params": params})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lmnb") as c:
            return await c.post("/generate", json={"text": "Hi", "rid": "again",
                                                   "sampling_params": {"max_new_tokens": 2}})

    response = asyncio.run(serve())
    assert kept_responses
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["id"] == "again"
    wait_idle(rt)
    rt.check_integrity()


STREAMED_RID = {
    "openai chat": ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 3,
                                             "stream": True, "rid": "twice"}),
    "openai completions": ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                               "stream": True, "rid": "twice"}),
    "sglang generate": ("/generate", {"text": "Hi", "stream": True, "rid": "twice",
                                      "sampling_params": {"max_new_tokens": 3}}),
}


@pytest.mark.parametrize("route", STREAMED_RID)
def test_a_streamed_rid_is_claimed_when_the_route_checks_it(rt, route):
    """Two streamed requests with one `rid`: the second is a plain 400 naming the rid, even
    while the first one's response has not started its body. The rid was taken only when a
    body started, so both passed the route's check and the later body failed with an
    in-stream error event. The first streams to its end; then the rid is free again."""
    from lmnb.server import create_app

    app = create_app(rt)
    path, body = STREAMED_RID[route]
    data = json.dumps(body).encode()

    async def serve() -> tuple[httpx.Response, list[dict], httpx.Response]:
        started, release = asyncio.Event(), asyncio.Event()
        messages = [{"type": "http.request", "body": data, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # a client that stays
            raise AssertionError

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.set()
                await release.wait()
            sent.append(message)

        first = asyncio.create_task(app(post_scope(path, data), receive, send))
        await started.wait()  # the first response holds its status line, its body unstarted
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lmnb") as c:
            second = await c.post(path, json=body)
            release.set()
            await first
            third = await c.post(path, json=body)
        return second, sent, third

    second, sent, third = asyncio.run(serve())
    assert second.status_code == 400, second.text
    assert "'twice' is already in use" in second.json()["error"]["message"]
    assert sent[0]["status"] == 200
    streamed = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert "error" not in streamed and streamed.endswith("data: [DONE]\n\n"), streamed
    assert third.status_code == 200 and "error" not in third.text, third.text
    wait_idle(rt)
    rt.check_integrity()


@pytest.mark.parametrize("route", STREAMED_RID)
def test_a_rid_claimed_by_a_response_that_never_started_is_freed(rt, route):
    """The client leaves before the streamed response starts (its body never runs): the rid
    the route's check claimed is free once the request ended, and its requests are aborted."""
    from lmnb.server import create_app

    app = create_app(rt)
    path, body = STREAMED_RID[route]
    data = json.dumps(body).encode()

    async def serve() -> httpx.Response:
        messages = [{"type": "http.disconnect"},
                    {"type": "http.request", "body": data, "more_body": False}]

        async def receive() -> dict:
            return messages.pop()

        async def send(message: dict) -> None:
            await asyncio.Event().wait()  # no write drains: the status line is never sent

        await app(post_scope(path, data), receive, send)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lmnb") as c:
            return await c.post(path, json=body)

    again = asyncio.run(serve())
    assert again.status_code == 200 and "error" not in again.text, again.text
    wait_idle(rt)
    rt.check_integrity()


FORCED = [{"type": "function", "function": {"name": "say", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
UNSTREAMED = {
    "openai completions": ("/v1/completions", {"prompt": "Hi", "n": 4}),
    "openai chat": ("/v1/chat/completions", {"messages": CHAT, "n": 4}),
    "openai chat, tools": ("/v1/chat/completions", {"messages": CHAT, "n": 4, "tools": FORCED,
                                                    "tool_choice": "required"}),
    "sglang generate": ("/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 300, "ignore_eos": True, "n": 4}}),
    "anthropic": ("/v1/messages", {"messages": CHAT}),
    "anthropic, tools": ("/v1/messages", {"messages": CHAT, "tools": [
        {"name": "say", "input_schema": FORCED[0]["function"]["parameters"]}],
        "tool_choice": {"type": "any"}}),
    "ollama generate": ("/api/generate", {"prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 300}}),
    "ollama chat": ("/api/chat", {"messages": CHAT, "stream": False,
                                  "options": {"num_predict": 300}}),
}


@pytest.mark.parametrize("route", UNSTREAMED)
def test_a_client_gone_from_an_unstreamed_request_aborts_it(server, rt, route):
    """Each API's whole (unstreamed) answer, with tools or without: a client that closes its
    connection while the requests generate has them aborted (as vLLM and SGLang do), their KV
    freed; they would run for 300 tokens each, slowed by a batch hook."""
    import socket
    import time

    path, fields = UNSTREAMED[route]
    body = json.dumps({"model": "tiny", "max_tokens": 300, "ignore_eos": True, **fields})
    before = wait_idle(rt)["generated_tokens"]
    rt.set_batch_hook(lambda batch: time.sleep(0.02))  # the requests outlast the client
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: lmnb\r\nAuthorization: Bearer {KEY}"
                         f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                         f"\r\n\r\n{body}".encode())
            deadline = time.monotonic() + 30
            while rt.stats()["running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rt.stats()["running"] > 0
        stats = wait_idle(rt)
    finally:
        rt.set_batch_hook(None)
    samples = fields.get("n", 1)
    assert stats["generated_tokens"] - before < samples * 300 * 0.9
    rt.check_integrity()


# ---- SGLang native ----------------------------------------------------------------------------
def test_native_generate_shapes(http, rt):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    one = http.post("/generate", json={"text": "Hello", "sampling_params": params}).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(rt.encode("Hello")) and meta["completion_tokens"] == 6
    assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)
    ids = http.post("/generate", json={"input_ids": rt.encode("Hello"),
                                       "sampling_params": params}).json()
    assert ids["text"] == one["text"] and ids["output_ids"] == one["output_ids"]
    batch = http.post("/generate", json={"text": ["Hello", "Bye"],
                                         "sampling_params": params}).json()
    assert isinstance(batch, list) and batch[0]["text"] == one["text"]
    logprobs = http.post("/generate", json={
        "text": "Hello", "sampling_params": params, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()
    meta = logprobs["meta_info"]
    assert len(meta["output_token_logprobs"]) == 6
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert token_id == one["output_ids"][0] and isinstance(text, str) and logprob <= 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    plain = http.post("/generate", json={"text": "Hello", "sampling_params": params,
                                         "return_logprob": True}).json()
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None


def test_native_generate_token_ids_logprob(http, rt):
    """SGLang's `token_ids_logprob` on `/generate`: `[logprob, id, text or None]` rows in the
    order asked, at every output and (with `logprob_start_len`) prompt position, as the runtime
    computes them; one list per prompt of a batch; a bad id is a 400 that names it."""
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    ids = [7, 3, 7]
    body = {"text": "Hello", "sampling_params": params, "return_logprob": True,
            "logprob_start_len": 0, "token_ids_logprob": ids}
    meta = http.post("/generate", json=body).json()["meta_info"]
    want = rt.generate("Hello", params, return_logprob=True, logprob_start_len=0,
                       token_ids_logprob=ids)["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == 4 and all([t for _, t, _ in row] == ids for row in rows)
    assert all(text is None for row in rows for _, _, text in row)
    assert [lp for row in rows for lp, _, _ in row] == pytest.approx(
        [lp for row in want["output_token_ids_logprobs"] for lp, _ in row], abs=1e-5)
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0] is None
    assert all([t for _, t, _ in row] == ids for row in inputs[1:])
    texts = http.post("/generate", json={**body, "return_text_in_logprobs": True}).json()
    assert all(isinstance(text, str) for _, _, text in
               texts["meta_info"]["output_token_ids_logprobs"][0])
    batch = http.post("/generate", json={**body, "text": ["Hello", "Bye"],
                                         "token_ids_logprob": [[1], None]}).json()
    assert [t for _, t, _ in batch[0]["meta_info"]["output_token_ids_logprobs"][0]] == [1]
    assert "output_token_ids_logprobs" not in batch[1]["meta_info"]
    bad = http.post("/generate", json={**body, "token_ids_logprob": [1, 10**9]})
    assert bad.status_code == 400 and "1000000000" in bad.text


def test_native_generate_batch_takes_logprob_options_per_prompt(http, rt):
    """SGLang's batch `/generate` takes `return_logprob`, `logprob_start_len`,
    `top_logprobs_num` (and `token_ids_logprob`) as one value per prompt: each result has the
    lists its own prompt asked for, as that prompt asked alone; streamed too. A list for one
    prompt, or of another length than the batch, is a 400 naming the field."""
    prompts = ["The weather today is", "Once upon a time", "Hello there"]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    asked = [{"return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
              "token_ids_logprob": [5, 9]},
             {"return_logprob": False, "logprob_start_len": None, "top_logprobs_num": 0,
              "token_ids_logprob": None},
             {"return_logprob": True, "logprob_start_len": None, "top_logprobs_num": 3,
              "token_ids_logprob": [7]}]
    per_prompt = {key: [options[key] for options in asked] for key in asked[0]}
    body = {"text": prompts, "sampling_params": params, **per_prompt}
    batch = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        events = sse_data(response.iter_lines())
    streamed = {event["index"]: event["meta_info"] for event in events}
    lists = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
             "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")

    def shape(meta: dict) -> dict:  # each list's token ids
        return {key: [t for _, t, _ in meta[key]] if key.endswith("token_logprobs") else
                [None if row is None else [t for _, t, _ in row] for row in meta[key]]
                for key in lists if key in meta}

    for index, (prompt, options) in enumerate(zip(prompts, asked, strict=True)):
        alone = http.post("/generate", json={"text": prompt, "sampling_params": params,
                                             **options}).json()
        meta = batch[index]["meta_info"]
        assert batch[index]["output_ids"] == alone["output_ids"]
        assert shape(meta) == shape(alone["meta_info"]) == shape(streamed[index])
        assert [lp for lp, _, _ in meta.get("output_token_logprobs", [])] == pytest.approx(
            [lp for lp, _, _ in alone["meta_info"].get("output_token_logprobs", [])], abs=1e-4)
    first, second, third = (shape(result["meta_info"]) for result in batch)
    assert set(first) == set(third) == set(lists) and not second
    assert len(first["input_token_logprobs"]) == batch[0]["meta_info"]["prompt_tokens"] - 1
    assert [len(row) for row in first["output_top_logprobs"]] == [2, 2, 2]
    assert [len(row) for row in third["output_top_logprobs"]] == [3, 3, 3]
    assert first["output_token_ids_logprobs"] == [[5, 9]] * 3
    assert third["output_token_ids_logprobs"] == [[7]] * 3
    for wrong in ({"top_logprobs_num": [1, 2, 3, 4]}, {"text": prompts[0]}):
        refused = http.post("/generate", json={**body, **wrong})
        assert refused.status_code == 400, refused.text
        assert "return_logprob" in refused.text or "top_logprobs_num" in refused.text


def test_native_generate_first_prompt_position_has_no_logprob(http, rt):
    """As SGLang's scheduler, which scores the prompt positions after `logprob_start_len`: the
    first position returned has no logprob (nor top or asked-for rows) from any start; the
    positions after it have the runtime's."""
    ids = rt.encode("The sky is blue and the grass is green")
    params = {"max_new_tokens": 0}
    options = {"return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [5]}
    for start in (0, 3):
        meta = http.post("/generate", json={"input_ids": ids, "sampling_params": params,
                                            "logprob_start_len": start, **options}
                         ).json()["meta_info"]
        want = rt.generate(input_ids=ids, sampling_params=params, logprob_start_len=start,
                           **options)["meta_info"]
        rows = meta["input_token_logprobs"]
        assert [token for _, token, _ in rows] == ids[start:]
        assert rows[0][0] is None and meta["input_top_logprobs"][0] is None
        assert meta["input_token_ids_logprobs"][0] is None
        assert [lp for lp, _, _ in rows[1:]] == pytest.approx(
            [lp for lp, _ in want["input_token_logprobs"][1:]], abs=1e-5)
        assert [[t for _, t, _ in row] for row in meta["input_top_logprobs"][1:]] == [
            [t for _, t in row] for row in want["input_top_logprobs"][1:]]
        assert len(meta["input_token_ids_logprobs"]) == len(ids) - start


def test_native_generate_token_origins(http):
    """lmnb's `return_token_origins` on SGLang's route: spans over the prompt and the output."""
    params = {"temperature": 0, "max_new_tokens": 6, "regex": "[0-9]{2}, [0-9]{2}"}
    meta = http.post("/generate", json={"text": "Numbers:", "sampling_params": params,
                                        "return_token_origins": True}).json()["meta_info"]
    assert meta["prompt_token_origins"][-1][2] == meta["prompt_tokens"]
    assert meta["output_token_origins"][-1][2] == meta["completion_tokens"]
    assert {origin for origin, _, _ in meta["output_token_origins"]} <= {
        "generated", "jump_forward"}
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]  # implied logprobs


def test_native_generate_stream_is_cumulative(http):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    whole = http.post("/generate", json={"text": "Hi", "sampling_params": params}).json()
    with http.stream("POST", "/generate", json={"text": "Hi", "sampling_params": params,
                                                "stream": True}) as response:
        events = sse_data(response.iter_lines())
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    with http.stream("POST", "/generate", json={"text": ["a", "b"], "sampling_params": params,
                                                "stream": True}) as response:
        events = sse_data(response.iter_lines())
    assert {e["index"] for e in events} == {0, 1}


def test_native_generate_stream_events_carry_sglangs_meta_info(http):
    """Each streamed event's meta_info has the fields SGLang's tokenizer manager puts in every
    chunk: the counts, and with `return_logprob` the logprob lists so far (cumulative, as the
    text is), each with the value the last event gives; only e2e_latency waits for the end."""
    prompt, params = "The weather today is", {"temperature": 0, "max_new_tokens": 5,
                                              "ignore_eos": True}
    http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    counts = {"id", "prompt_tokens", "weight_version", "total_retractions", "reasoning_tokens",
              "cached_tokens"}
    lists = {"input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
             "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"}
    logprobs = {"return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
                "token_ids_logprob": [5, 9], "return_text_in_logprobs": True}
    for extra, keys in (({}, set()), (logprobs, lists)):
        with http.stream("POST", "/generate", json={"text": prompt, "sampling_params": params,
                                                    "stream": True, **extra}) as response:
            events = sse_data(response.iter_lines())
        last = events[-1]["meta_info"]
        assert len(events) > 1 and (last["cached_tokens"] > 0 or extra)
        for event in events[:-1]:
            meta, count = event["meta_info"], len(event["output_ids"])
            assert "e2e_latency" not in meta and meta["finish_reason"] is None
            assert meta["completion_tokens"] == count
            assert {key: meta[key] for key in counts} == {key: last[key] for key in counts}
            assert {key: meta[key] for key in keys} == {
                key: last[key] if key.startswith("input") else last[key][:count] for key in keys}
            assert meta.get("output_token_logprobs_length", count) == count
            assert ("output_token_logprobs_length" in meta) == bool(extra)


def test_native_generate_reports_the_given_rid(http):
    """SGLang's `rid` comes back as `meta_info.id`: a string for one request, `rid_i` per
    result of a batch or of n > 1, a list with one id per prompt."""
    params = {"max_new_tokens": 2}
    out = http.post("/generate", json={"text": "Hi", "rid": "rid-one",
                                       "sampling_params": params}).json()
    assert out["meta_info"]["id"] == "rid-one"
    batch = http.post("/generate", json={"text": ["a", "b"], "rid": ["rid-a", "rid-b"],
                                         "sampling_params": {**params, "n": 2}}).json()
    assert [r["meta_info"]["id"] for r in batch] == ["rid-a_0", "rid-a_1", "rid-b_0",
                                                      "rid-b_1"]
    named = http.post("/generate", json={"text": ["a", "b"], "rid": "rid-batch",
                                         "sampling_params": params}).json()
    assert [r["meta_info"]["id"] for r in named] == ["rid-batch_0", "rid-batch_1"]
    with http.stream("POST", "/generate", json={"text": ["a", "b"], "rid": ["s-a", "s-b"],
                                                "stream": True, "sampling_params": params}
                     ) as response:
        events = sse_data(response.iter_lines())
    assert {(e["index"], e["meta_info"]["id"]) for e in events} == {(0, "s-a"), (1, "s-b")}
    wrong = http.post("/generate", json={"text": ["a", "b"], "rid": ["only-one"],
                                         "sampling_params": params})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "rid"


def test_native_abort_request_stops_a_running_request(server, http, rt):
    """`POST /abort_request {"rid"}` ends a running request with finish_reason abort (its KV
    freed), streamed or not; an unknown rid is a no-op 200, as in SGLang; a rid in flight is
    not taken twice."""
    params = {"max_new_tokens": 400, "ignore_eos": True}
    body = {"text": "Go on", "rid": "abort-1", "stream": True, "sampling_params": params}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as streaming, \
            gated_passes(rt) as gate:  # the request runs until the test lets it
        gate.allow()  # the prefill: its token is the first event
        with streaming.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
            taken = http.post("/generate", json={**body, "stream": False})
            assert taken.status_code == 400 and "abort-1" in taken.json()["error"]["message"]
            aborted = http.post("/abort_request", json={"rid": "abort-1"})
            assert aborted.status_code == 200, aborted.text
            gate.open()
            events = sse_data(lines)
    last = events[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["id"] == "abort-1"
    assert last["completion_tokens"] == len(events[-1]["output_ids"]) < 400
    assert http.post("/abort_request", json={"rid": "abort-1"}).status_code == 200
    wait_idle(rt)
    rt.check_integrity()

    async def whole_then_abort(gate: PassGate) -> list:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            task = asyncio.create_task(c.post("/generate", json={
                "text": ["x", "y"], "rid": ["abort-2a", "abort-2b"],
                "sampling_params": params}))
            while not task.done():  # until the call is in flight and aborted
                await asyncio.sleep(0.02)
                assert (await c.post("/abort_request", json={"abort_all": True})
                        ).status_code == 200
                gate.allow()  # a pass per round: 400 tokens take 400 rounds
            return task.result().json()

    with gated_passes(rt) as gate:
        results = asyncio.run(whole_then_abort(gate))
    assert [r["meta_info"]["id"] for r in results] == ["abort-2a", "abort-2b"]
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert all(r["meta_info"]["completion_tokens"] < 400 for r in results)
    wait_idle(rt)
    rt.check_integrity()


def test_native_abort_request_ends_one_request_of_a_batch(server, http, rt):
    """A `/generate` call of two prompts: aborting one rid ends that request alone (finish_reason
    abort, its KV freed); the other runs to its length."""
    params = {"max_new_tokens": 300, "ignore_eos": True}
    body = {"text": ["Go on", "Tell me"], "rid": ["one-a", "one-b"], "stream": True,
            "sampling_params": params}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as streaming, \
            gated_passes(rt) as gate:  # the requests run until the test lets them
        gate.allow()  # the prefill: their first tokens
        with streaming.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert http.post("/abort_request", json={"rid": "one-a"}).status_code == 200
            gate.open()
            events = sse_data(lines)
    last = {event["meta_info"]["id"]: event for event in events
            if event["meta_info"]["finish_reason"] is not None}
    assert last["one-a"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["one-a"]["meta_info"]["completion_tokens"] < 300
    assert last["one-b"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["one-b"]["output_ids"]) == 300
    wait_idle(rt)
    rt.check_integrity()


def test_openai_rid_is_aborted_by_abort_request(server, client, http, rt):
    """SGLang's `rid` on `/v1/chat/completions` and `/v1/completions` names the requests as on
    `/generate` (`rid_i` for `n` > 1, one id per prompt in a list), so `/abort_request {"rid"}`
    ends them with finish_reason abort (their KV freed); a rid in flight is a 400. Without a
    rid, the response's id finds the request (SGLang's response id is its rid), and
    `abort_all` ends it. `rid` was ignored: nothing could abort an OpenAI request but a
    disconnect. The runtime's passes are let through one at a time (`gated_passes`), so a
    request is still running when the test acts on it, however slow the machine."""
    long = {"max_tokens": 400, "extra_body": {"ignore_eos": True, "rid": "x"}}
    with gated_passes(rt) as gate:
        gate.allow()  # the prefill: its token is the first chunk
        stream = client.chat.completions.create(model="tiny", messages=CHAT, stream=True, **long)
        with stream:
            chunks = iter(stream)
            assert next(chunks).choices[0].finish_reason is None
            with pytest.raises(openai.BadRequestError, match="'x'") as taken:
                client.completions.create(model="tiny", prompt="Hi", **long)
            assert taken.value.param == "rid"
            assert http.post("/abort_request", json={"rid": "x"}).status_code == 200
            gate.open()
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "abort" and len(finishes) < 400
    for abort in ("by its id", {"abort_all": True}):
        with gated_passes(rt) as gate:
            gate.allow()
            stream = client.chat.completions.create(model="tiny", messages=CHAT, stream=True,
                                                    max_tokens=400,
                                                    extra_body={"ignore_eos": True})
            with stream:
                chunks = iter(stream)
                first = next(chunks)
                body = {"rid": first.id} if abort == "by its id" else abort
                assert http.post("/abort_request", json=body).status_code == 200
                gate.open()
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "abort" and len(finishes) < 400, abort
    wait_idle(rt)

    def completion_then_abort() -> openai.types.Completion:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, gated_passes(rt) as gate:
            running = pool.submit(client.completions.create, model="tiny",
                                  prompt=["Go on", "Tell me"], n=2, max_tokens=400,
                                  extra_body={"ignore_eos": True, "rid": ["p", "q"]})
            while not running.done():  # until the call is in flight and aborted
                for rid in ("p_0", "p_1", "q_0", "q_1"):
                    assert http.post("/abort_request", json={"rid": rid}).status_code == 200
                gate.allow()  # a pass per round: 400 tokens take 400 rounds
            return running.result()

    out = completion_then_abort()
    assert [c.finish_reason for c in out.choices] == ["abort"] * 4
    assert out.usage.completion_tokens < 4 * 400
    with pytest.raises(openai.BadRequestError, match="rid has 1 ids for 2 prompts"):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=1,
                                  extra_body={"rid": ["only-one"]})
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools") as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                       tools=[tool], extra_body={"rid": "t"})
    assert refused.value.param == "rid"
    wait_idle(rt)
    rt.check_integrity()


DIGITS = {"type": "function", "function": {"name": "digits", "parameters": {
    "type": "object", "properties": {"d": {"type": "array", "minItems": 300, "items": {
        "type": "integer", "minimum": 0, "maximum": 9}}}, "required": ["d"]}}}


def test_abort_all_ends_the_running_requests_of_every_api(server, rt):
    """`/abort_request {"abort_all": true}` ends every running request, as SGLang's does, on
    every API: tool runs (forced calls, whose arguments need over 300 tokens), Anthropic's and
    Ollama's routes too, each ending as its API renders an abort (OpenAI and SGLang:
    finish_reason `abort`, not `tool_calls`; Ollama: done_reason `abort`; Anthropic, which has
    no such reason, `end_turn`, not `tool_use`), far short of their 250 tokens, every KV slot
    back. It reached only the native and OpenAI requests without tools. The runtime's passes
    are let through one a round until each request has its first token (`gated_passes`): all
    are running when the abort comes."""
    tokens = 250  # fits the tiny model's context after the tools' prompt

    async def native(c: httpx.AsyncClient) -> AsyncIterator[dict]:
        body = {"text": "Go on", "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with c.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    yield json.loads(line[len("data: "):])

    async def opened(events: AsyncIterator[dict]) -> AsyncIterator[dict]:
        return events  # as the clients' `create(stream=True)` give theirs

    async def run(gate: PassGate) -> dict[str, list]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c, \
                openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY,
                                   max_retries=0) as gpt, \
                anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY,
                                         max_retries=0) as claude, \
                ollama.AsyncClient(host=server.url, headers=AUTH) as llama:
            options = {"num_predict": tokens, "temperature": 0}
            streams = {
                "sglang": opened(native(c)),
                "openai tools": gpt.chat.completions.create(
                    model="tiny", messages=CHAT, tools=[DIGITS], tool_choice="required",
                    max_tokens=tokens, stream=True, stream_options={"include_usage": True}),
                "anthropic": claude.messages.create(model="tiny", messages=CHAT,
                                                    max_tokens=tokens, stream=True,
                                                    extra_body={"temperature": 0}),
                # the OpenAI tool run's prompt and constraint: two identical requests that
                # jump forward (one was once held back until the other ran to its end)
                "anthropic tools": claude.messages.create(
                    model="tiny", messages=CHAT,
                    max_tokens=tokens, stream=True,
                    tools=[{"name": "digits", "input_schema": DIGITS["function"]["parameters"]}],
                    tool_choice={"type": "any"}),
                "ollama generate": llama.generate(model="tiny", prompt="Go on", stream=True,
                                                  options=options),
                "ollama chat": llama.chat(model="tiny", messages=CHAT, stream=True,
                                          options=options),
            }
            started = {name: asyncio.Event() for name in streams}

            async def read(name: str, opening: Awaitable[AsyncIterable[Any]]) -> list:
                out = []
                async for event in await opening:
                    out.append(event)
                    started[name].set()
                return out

            tasks = {name: asyncio.create_task(read(name, opening))
                     for name, opening in streams.items()}
            try:
                while not all(event.is_set() for event in started.values()):
                    for name, task in tasks.items():  # a request refused: its error, now
                        if task.done() and not started[name].is_set():
                            task.result()
                    gate.allow()  # a pass per round, until every request has its first token
                    await asyncio.sleep(0.02)
                assert (await c.post("/abort_request", json={"abort_all": True})
                        ).status_code == 200
                gate.open()
                return {name: await task for name, task in tasks.items()}
            finally:
                for task in tasks.values():
                    task.cancel()

    with gated_passes(rt) as gate:
        ended = asyncio.run(run(gate))
    native_last = ended["sglang"][-1]["meta_info"]
    tool_chunks = ended["openai tools"]
    deltas = {name: [e for e in ended[name] if e.type == "message_delta"][-1]
              for name in ("anthropic", "anthropic tools")}
    endings = {  # (how it ended, the tokens it made)
        "sglang": (native_last["finish_reason"]["type"], native_last["completion_tokens"]),
        "openai tools": ([c.choices[0].finish_reason for c in tool_chunks if c.choices][-1],
                         tool_chunks[-1].usage.completion_tokens),
        **{name: (delta.delta.stop_reason, delta.usage.output_tokens)
           for name, delta in deltas.items()},
        **{name: (ended[name][-1].done_reason, ended[name][-1].eval_count)
           for name in ("ollama generate", "ollama chat")}}
    assert {name: how for name, (how, _) in endings.items()} == {
        "sglang": "abort", "openai tools": "abort", "anthropic": "end_turn",
        "anthropic tools": "end_turn", "ollama generate": "abort", "ollama chat": "abort"
    }, endings
    assert all(made < tokens / 2 for _, made in endings.values()), endings
    wait_idle(rt)
    rt.check_integrity()


def test_native_info_routes(http, rt):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    server_info = http.get("/get_server_info").json()
    assert server_info["max_total_num_tokens"] == rt.max_total_tokens
    assert "internal_states" in server_info and "version" in server_info
    assert http.get("/health_generate").status_code == 200
    wait_idle(rt)
    assert http.post("/flush_cache").status_code == 200
    assert rt.stats()["tree_tokens"] == 0


# ---- Anthropic and Ollama ---------------------------------------------------------------------
def test_anthropic_messages(http):
    body = {"model": "tiny", "max_tokens": 6, "system": "Be brief.", "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    whole = http.post("/v1/messages", json=body).json()
    assert whole["type"] == "message" and whole["role"] == "assistant"
    assert whole["content"][0]["type"] == "text"
    assert whole["stop_reason"] in ("end_turn", "max_tokens")
    assert whole["usage"]["input_tokens"] > 0
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        lines = list(response.iter_lines())
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert datas[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    text = whole["content"][0]["text"]
    assert len(text) > 3
    cut = http.post("/v1/messages", json={**body, "stop_sequences": [text[2:4]]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == text[2:4]
    assert cut["content"][0]["text"] == text[:text.index(text[2:4])]


def test_anthropic_streamed_usage_equals_the_whole_response(claude):
    """The SDK takes a stream's usage totals from message_delta (message_start comes before
    the cached prefix is known): a cached prompt counts as cache reads, streamed or not.
    `cache_creation_input_tokens` is 0 (no `cache_control` writes), not missing: Anthropic's
    total input is input + cache creation + cache read tokens, which a None breaks."""
    kwargs = dict(model="tiny", max_tokens=4, system="Usage review.",
                  messages=[{"role": "user", "content": "Count my tokens."}])
    claude.messages.create(**kwargs)  # the prompt is cached from now on
    whole = claude.messages.create(**kwargs).usage
    assert whole.cache_read_input_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message().usage
    assert (streamed.input_tokens, streamed.cache_read_input_tokens) == (
        whole.input_tokens, whole.cache_read_input_tokens)
    counted = claude.messages.count_tokens(model="tiny", system=kwargs["system"],
                                           messages=kwargs["messages"]).input_tokens
    for usage in (whole, streamed):
        assert usage.cache_creation_input_tokens == 0
        assert (usage.input_tokens + usage.cache_creation_input_tokens
                + usage.cache_read_input_tokens) == counted


def test_anthropic_usage_has_the_standard_tier_and_no_cache_writes(claude):
    """A message's `usage` has Anthropic's `service_tier` ("standard": lmnb has no other) and
    `cache_creation`, the per-TTL split of `cache_creation_input_tokens` (0 each: nothing is
    written by `cache_control`), whole or streamed (the SDK keeps message_start's), with tools
    or without; both were missing (None in the SDK). message_delta's usage has only
    `MessageDeltaUsage`'s fields."""
    tool = {"name": "f", "input_schema": {"type": "object"}}
    requests = [dict(model="tiny", max_tokens=3, messages=CHAT),
                dict(model="tiny", max_tokens=3, messages=CHAT, tools=[tool],
                     tool_choice={"type": "any"})]
    for kwargs in requests:
        with claude.messages.stream(**kwargs) as stream:
            deltas = [event.usage.model_dump(exclude_none=True) for event in stream
                      if event.type == "message_delta"]
            streamed = stream.get_final_message().usage
        for usage in (claude.messages.create(**kwargs).usage, streamed):
            assert usage.service_tier == "standard"
            assert usage.cache_creation == anthropic.types.CacheCreation(
                ephemeral_1h_input_tokens=0, ephemeral_5m_input_tokens=0)
        (delta,) = deltas
        assert set(delta) == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                              "cache_read_input_tokens"}


def test_anthropic_assistant_prefill_is_continued(claude, rt):
    """Anthropic: 'if the final message uses the assistant role, the response content will
    continue immediately from the content in that message'."""
    prefill = "The colour is"
    messages = [*CHAT, {"role": "assistant", "content": prefill}]
    out = claude.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                                 messages=messages)
    prompt = rt.apply_chat_template(CHAT) + prefill
    direct = rt.generate(prompt, {"temperature": 0, "max_new_tokens": 4})
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(rt.encode(prompt))
    assert out.content[0].text == direct["text"]
    counted = claude.messages.count_tokens(model="tiny", messages=messages)
    assert counted.input_tokens == len(rt.encode(prompt))


class Pet(BaseModel):  # the SDK drops string lengths and number bounds from the schema it sends
    kind: Literal["cat", "dog"]
    tame: bool


def test_anthropic_structured_output_follows_its_schema(claude):
    """`output_config.format` (the SDK's `messages.parse(output_format=...)`) constrains the
    text to its JSON schema, whole and streamed; with tools it is refused, not ignored."""
    kwargs = dict(model="tiny", max_tokens=60, messages=CHAT)
    for seed in (0, 1):
        out = claude.messages.parse(**kwargs, output_format=Pet, extra_body={"seed": seed})
        assert isinstance(out.parsed_output, Pet) and out.stop_reason == "end_turn"
    with claude.messages.stream(**kwargs, output_format=Pet) as stream:
        assert isinstance(stream.get_final_message().parsed_output, Pet)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    raw = claude.messages.create(**kwargs, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(raw.content[0].text), schema)
    for fmt in ({"type": "json_schema"}, "json"):
        with pytest.raises(anthropic.BadRequestError, match="output_config"):
            claude.messages.create(**kwargs, output_config={"format": fmt})
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        claude.messages.create(**kwargs, output_config={"format": {"type": "json_schema",
                                                                   "schema": schema}},
                               tools=[{"name": "f", "input_schema": {"type": "object"}}],
                               tool_choice={"type": "any"})


def test_anthropic_models_list_and_retrieve(claude, rt):
    """The `anthropic` SDK's models.list / retrieve read Anthropic's model fields from the
    same `/v1/models` the `openai` client reads (its fields were all None)."""
    (listed,) = list(claude.models.list())
    model = claude.models.retrieve("tiny")
    for info in (listed, model):
        assert (info.id, info.type, info.display_name) == ("tiny", "model", "tiny")
        assert isinstance(info.created_at, datetime.datetime)
        assert info.max_input_tokens == rt.context_len
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("claude-opus")


def test_anthropic_responses_carry_a_request_id(claude):
    """Anthropic's API names a response's id `request-id` (the `anthropic` SDK's public
    `message._request_id`, `MessageStream.request_id` and `APIStatusError.request_id`); lmnb
    sent it only as OpenAI's `x-request-id`, so they were None. Both headers carry one id:
    a new `req_...`, or the client's own `X-Request-Id`."""
    message = claude.messages.create(model="tiny", max_tokens=2, messages=CHAT)
    assert message._request_id.startswith("req_")
    raw = claude.messages.with_raw_response.create(model="tiny", max_tokens=2, messages=CHAT)
    assert raw.request_id == raw.headers["x-request-id"] != message._request_id
    mine = {"X-Request-Id": "trace-7"}
    with claude.messages.stream(model="tiny", max_tokens=2, messages=CHAT,
                                extra_headers=mine) as stream:
        assert stream.request_id == "trace-7"
    counted = claude.messages.count_tokens(model="tiny", messages=CHAT, extra_headers=mine)
    assert counted._request_id == "trace-7"
    assert claude.models.retrieve("tiny")._request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=0, messages=CHAT, extra_headers=mine)
    assert caught.value.request_id == "trace-7"


def test_anthropic_errors_have_anthropic_bodies(server, claude):
    """Anthropic's error body is `{"type": "error", "error": {"type", "message"}}` (its SDK's
    `error.type` reads `error.type`), for a refused request, a body that fails validation and
    a wrong key alike."""
    refused = dict(model="tiny", max_tokens=4, messages=CHAT,
                   tools=[{"name": "f", "input_schema": {"type": "object"}}],
                   tool_choice={"type": "tool", "name": "g"})
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(**refused)
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": caught.value.api_message}}
    assert "'g'" in caught.value.api_message and caught.value.type == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": 7}])
    assert caught.value.body["type"] == "error" and "messages.0.content" in (
        caught.value.api_message)
    unvalidated = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                             json={"model": "tiny", "messages": CHAT})
    assert unvalidated.status_code == 400
    assert unvalidated.json()["type"] == "error" and "max_tokens" in (
        unvalidated.json()["error"]["message"])
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(model="tiny", max_tokens=2, messages=CHAT)
    assert caught.value.body["type"] == "error"
    assert caught.value.type == "authentication_error"


def test_anthropic_max_tokens_is_at_least_one(claude):
    """Anthropic's `max_tokens` is >= 1 (its API and SGLang's endpoint refuse 0); 0 was taken
    and answered with an empty text and stop_reason "max_tokens"."""
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError, match="max_tokens") as caught:
            claude.messages.create(model="tiny", max_tokens=0, messages=CHAT, stream=stream)
        assert caught.value.type == "invalid_request_error"
    assert claude.messages.create(model="tiny", max_tokens=1, messages=CHAT).usage.output_tokens


def test_anthropic_turns_are_user_or_assistant_with_content(claude):
    """Anthropic's messages are user and assistant turns, each with content (the system prompt
    is the top-level `system`); other roles and a missing content are 400s, not prompts."""
    for turn, where in (({"role": "system", "content": "Be brief."}, "messages.0.role"),
                        ({"role": "tool", "content": "22 C"}, "messages.0.role"),
                        ({"role": "user"}, "messages.0.content")):
        with pytest.raises(anthropic.BadRequestError, match=where):
            claude.messages.create(model="tiny", max_tokens=2, messages=[turn, *CHAT])
        with pytest.raises(anthropic.BadRequestError, match=where):
            claude.messages.count_tokens(model="tiny", messages=[turn, *CHAT])


def test_anthropic_system_blocks_are_joined_by_newlines(claude, rt):
    """A `system` given as text blocks is their texts joined by "\\n", empty ones left out, as
    SGLang's endpoint joins them (they were run together: "Be brief.Answer in French.")."""
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""},
              {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}]
    prompt = rt.apply_chat_template([{"role": "system", "content": "Be brief.\nAnswer in French."},
                                     *CHAT])
    counted = claude.messages.count_tokens(model="tiny", system=blocks, messages=CHAT)
    assert counted.input_tokens == len(rt.encode(prompt))
    out = claude.messages.create(model="tiny", max_tokens=3, extra_body={"temperature": 0},
                                 system=blocks, messages=CHAT)
    direct = rt.generate(prompt, {"temperature": 0, "max_new_tokens": 3})
    assert out.content[0].text == direct["text"]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(rt.encode(prompt))


def test_anthropic_tool_result_text_blocks_are_joined_by_newlines(claude):
    """A `tool_result` whose content is text blocks is their texts joined by "\\n", empty ones
    left out, as a `system` of blocks is and as SGLang's endpoint joins both (they were run
    together: "22 Csunny")."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}

    def counted(content: str | list) -> int:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
        return claude.messages.count_tokens(model="tiny", messages=[
            *CHAT, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]}]).input_tokens

    blocks = [{"type": "text", "text": "22 C"}, {"type": "text", "text": ""},
              {"type": "text", "text": "sunny"}]
    assert counted("22 C\nsunny") != counted("22 Csunny")
    assert counted(blocks) == counted("22 C\nsunny")


def test_anthropic_thinking_blocks_of_earlier_turns_leave_the_prompt(claude):
    """An assistant turn replayed with its `thinking` / `redacted_thinking` blocks (as a
    client sends back a response) is taken, and, as Anthropic does with earlier turns'
    thinking, those blocks are not in the prompt."""
    reply = [{"type": "text", "text": "Blue."}]
    thought = [{"type": "thinking", "thinking": "Colours: blue, red.", "signature": "c2ln"},
               {"type": "redacted_thinking", "data": "ZW5j"}]
    history = [*CHAT, {"role": "assistant", "content": [*thought, *reply]},
               {"role": "user", "content": "Another?"}]
    plain = [*CHAT, {"role": "assistant", "content": reply}, history[-1]]
    counted = claude.messages.count_tokens(model="tiny", messages=history).input_tokens
    assert counted == claude.messages.count_tokens(model="tiny", messages=plain).input_tokens
    usage = claude.messages.create(model="tiny", max_tokens=2, messages=history).usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted


def test_ollama_generate_and_chat(http):
    options = {"temperature": 0, "num_predict": 5}
    whole = http.post("/api/generate", json={"model": "tiny", "prompt": "Hi",
                                             "options": options, "stream": False}).json()
    assert whole["done"] is True and whole["eval_count"] <= 5
    assert {"response", "prompt_eval_count", "done_reason", "created_at"} <= set(whole)
    with http.stream("POST", "/api/generate", json={"model": "tiny", "prompt": "Hi",
                                                    "options": options}) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["response"] for line in lines) == whole["response"]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    chat = http.post("/api/chat", json={"model": "tiny", "messages": CHAT, "options": options,
                                        "stream": False}).json()
    assert chat["message"]["role"] == "assistant" and chat["done"] is True
    with http.stream("POST", "/api/chat", json={"model": "tiny", "messages": CHAT,
                                                "options": options}) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == chat["message"]["content"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = http.post("/api/chat", json={"model": "tiny", "messages": CHAT, "stream": False,
                                          "format": schema, "options": {"num_predict": 30}})
    jsonschema.validate(json.loads(shaped.json()["message"]["content"]), schema)


def test_ollama_bad_requests_are_400_with_ollama_error_bodies(server, http):
    """Ollama's error body is `{"error": "message"}` (the client's `ResponseError.error` is
    that string); an option of the wrong type is a 400, not a comparison failing deep down."""
    response = http.post("/api/generate", json={"model": "tiny", "prompt": "Hi",
                                                "stream": False,
                                                "options": {"num_predict": "5"}})
    assert response.status_code == 400 and "num_predict" in response.json()["error"]
    client = ollama.Client(host=server.url, headers=AUTH)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="tiny", messages=[{"role": "wizard", "content": "x"}],
                    options={"num_predict": 2})
    assert caught.value.status_code == 400
    assert isinstance(caught.value.error, str) and "wizard" in caught.value.error
    unauthorized = httpx.post(f"{server.url}/api/chat", json={"messages": CHAT})
    assert unauthorized.status_code == 401 and isinstance(unauthorized.json()["error"], str)


def test_ollama_unknown_model_is_a_404(server):
    """Ollama answers a model it does not have with a 404 (`model 'x' not found`, the client's
    `ResponseError.status_code`) on /api/generate and /api/chat, as on /api/show; lmnb served
    its one model under any name. `name:latest` is the served model."""
    client = ollama.Client(host=server.url, headers=AUTH)
    calls = [lambda: client.generate(model="llama3", prompt="Hi", options={"num_predict": 1}),
             lambda: client.generate(model="llama3"),
             lambda: client.chat(model="llama3", messages=CHAT, options={"num_predict": 1}),
             lambda: list(client.chat(model="llama3", messages=CHAT, stream=True))]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404
        assert caught.value.error == "model 'llama3' not found"
    out = client.generate(model="tiny:latest", prompt="Hi", options={"num_predict": 1})
    assert out.done and out.model == "tiny:latest"


def test_ollama_request_without_a_model_is_refused_in_ollamas_words(server, http):
    """Ollama serves no default model: /api/chat and /api/show without one are a 400 `model is
    required`, /api/generate a 404 `model '' not found`, /api/pull a 400 `invalid model name`
    (server/routes.go and its tests); lmnb served its model to such requests. (The ollama
    client refuses an empty name itself; curl and other clients send it.)"""
    refused = [("/api/chat", {"messages": CHAT}, 400, "model is required"),
               ("/api/chat", {"model": "", "messages": CHAT, "stream": True}, 400,
                "model is required"),
               ("/api/chat", {"messages": []}, 400, "model is required"),
               ("/api/generate", {"prompt": "Hi"}, 404, "model '' not found"),
               ("/api/generate", {"model": ""}, 404, "model '' not found"),
               ("/api/show", {}, 400, "model is required"),
               ("/api/pull", {"model": ""}, 400, "invalid model name")]
    for path, body, status, words in refused:
        response = http.post(path, json=body)
        assert (response.status_code, response.json()) == (status, {"error": words}), body
    client = ollama.Client(host=server.url, headers=AUTH)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=" ", messages=CHAT)
    assert (caught.value.status_code, caught.value.error) == (400, "model is required")


def test_ollama_version_and_what_one_served_model_cannot_do(server, http):
    """`/api/version` is lmnb's; what a server of one model loaded from its files cannot do
    (pull another model, push, create, copy, delete, embeddings) is a 501 saying so in
    Ollama's error body; these were FastAPI's bare 404 `Not Found`, which reads as a missing
    model. The served model is here already: pulling it succeeds, streamed or not."""
    from lmnb import __version__

    assert http.get("/api/version").json() == {"version": __version__}
    client = ollama.Client(host=server.url, headers=AUTH)
    assert client.pull("tiny").status == "success"
    assert [p.status for p in client.pull("tiny:latest", stream=True)] == ["success"]
    calls = {"pull": lambda: client.pull("llama3"), "push": lambda: client.push("tiny"),
             "create": lambda: client.create(model="mine", from_="tiny"),
             "copy": lambda: client.copy("tiny", "mine"), "delete": lambda: client.delete("tiny"),
             "embed": lambda: client.embed(model="tiny", input="Hi"),
             "embeddings": lambda: client.embeddings(model="tiny", prompt="Hi")}
    for word, call in calls.items():
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 501, word
        assert "lmnb" in caught.value.error and word[:5] in caught.value.error


def test_ollama_empty_prompt_loads_the_model_without_generating(server, rt):
    """Ollama: 'If an empty prompt is provided, the model will be loaded into memory': an
    empty `response` with `done_reason: "load"` (clients preload models so); the same for a
    chat without messages."""
    before = wait_idle(rt)["generated_tokens"]
    client = ollama.Client(host=server.url, headers=AUTH)
    out = client.generate(model="tiny", stream=False)
    assert out.response == "" and out.done
    assert out.done_reason == "load" and not out.eval_count
    (streamed,) = list(client.generate(model="tiny", stream=True))
    assert streamed.done_reason == "load"
    chat = client.chat(model="tiny", messages=[])
    assert chat.done_reason == "load" and chat.message.content == ""
    assert wait_idle(rt)["generated_tokens"] == before


def test_ollama_keep_alive_zero_cannot_unload_the_served_model(server, http):
    """Ollama unloads a model for an empty prompt (or no messages) with `keep_alive` 0 and
    answers `done_reason: "unload"`; lmnb keeps its one model loaded while it serves, so that
    is a 501 saying so (it answered "load"). A `keep_alive` that is no duration is a 400, as
    Ollama's; other durations change nothing, nor does 0 with a prompt."""
    client = ollama.Client(host=server.url, headers=AUTH)
    unloads = [lambda: client.generate(model="tiny", keep_alive=0),
               lambda: client.chat(model="tiny", messages=[], keep_alive="0s")]
    for call in unloads:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 501 and "unload" in caught.value.error
    assert client.generate(model="tiny", keep_alive="5m").done_reason == "load"
    assert client.chat(model="tiny", messages=[], keep_alive=-1).done_reason == "load"
    # With a prompt, Ollama generates, then unloads the idle model (server/sched.go): the
    # reply is what the client asks for, so lmnb gives it as without keep_alive and keeps the
    # model loaded (`/api/ps` still lists it).
    options = {"temperature": 0, "num_predict": 4}
    plain = client.generate(model="tiny", prompt="Hi", options=options)
    for keep_alive in (0, "0s"):
        out = client.generate(model="tiny", prompt="Hi", options=options, keep_alive=keep_alive)
        assert (out.response, out.done_reason) == (plain.response, plain.done_reason)
        *_, last = client.chat(model="tiny", messages=CHAT, options=options, stream=True,
                               keep_alive=keep_alive)
        assert last.done and last.done_reason in ("stop", "length") and last.eval_count
    assert [m.name for m in client.ps().models] == ["tiny"]
    bad = http.post("/api/generate", json={"model": "tiny", "prompt": "Hi", "keep_alive": "soon"})
    assert bad.status_code == 400 and "soon" in bad.json()["error"]


def test_ollama_generate_context_continues_the_text(server, rt):
    """/api/generate's last object carries `context`, the tokens of the prompt and the response
    (not in raw mode), and a request's `context` goes before its prompt, as Ollama's (the
    client's short conversational memory); lmnb sent none and dropped the one given."""
    client = ollama.Client(host=server.url, headers=AUTH)
    options = {"temperature": 0, "num_predict": 4}
    first = client.generate(model="tiny", prompt="Hi", options=options)
    prompt = rt.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert first.context == rt.encode(prompt + first.response)
    *_, last = client.generate(model="tiny", prompt="Hi", options=options, stream=True)
    assert last.done and last.context == first.context
    second = client.generate(model="tiny", prompt="More", options=options,
                             context=first.context)
    follow = rt.tokenizer.decode(first.context) + rt.apply_chat_template(
        [{"role": "user", "content": "More"}])
    direct = rt.generate(follow, {"temperature": 0, "max_new_tokens": 4})
    assert second.response == direct["text"]
    assert second.prompt_eval_count == len(rt.encode(follow))
    assert second.context == rt.encode(follow + second.response)
    assert client.generate(model="tiny", prompt="Hi", raw=True, options=options).context is None
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="tiny", prompt="More", context=[-1])
    assert caught.value.status_code == 400 and "context" in caught.value.error


def test_ollama_raw_mode_refuses_system_template_and_context(server):
    """Ollama's raw mode sends the prompt as it is: with `system`, `template` or `context` too
    it is a 400 in Ollama's words; lmnb dropped them silently."""
    client = ollama.Client(host=server.url, headers=AUTH)
    for extra in ({"system": "Be brief."}, {"template": "{{ .Prompt }}"}, {"context": [1, 2]}):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="Hi", raw=True, **extra)
        assert caught.value.status_code == 400
        assert caught.value.error == "raw mode does not support template, system, or context"


def test_ollama_fields_lmnb_cannot_honour_are_refused(server):
    """`template` (a Go template lmnb cannot run: the model's chat template is used), `suffix`
    (fill-in-the-middle, Ollama's `insert` capability) and `think` (lmnb's /api/show lists
    neither) were dropped silently; they are 400s, the latter two in Ollama's words for a model
    without the capability. `think: false` asks nothing."""
    client = ollama.Client(host=server.url, headers=AUTH)
    refused = [("template", lambda: client.generate(model="tiny", prompt="Hi",
                                                    template="{{ .Prompt }}")),
               ('"tiny" does not support insert', lambda: client.generate(
                   model="tiny", prompt="def f(", suffix="    return x")),
               ('"tiny" does not support thinking', lambda: client.chat(
                   model="tiny", messages=CHAT, think=True)),
               ('"tiny" does not support thinking', lambda: client.generate(
                   model="tiny", prompt="Hi", think="high"))]
    for words, call in refused:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400 and words in caught.value.error
    assert "insert" not in client.show("tiny").capabilities
    assert client.chat(model="tiny", messages=CHAT, think=False,
                       options={"num_predict": 1}).done


def test_ollama_durations_split_the_prompt_from_the_output(server):
    """Ollama's last object times the prompt (`prompt_eval_duration`, until the first output)
    apart from the output (`eval_duration`), in nanoseconds; clients divide the counts by
    them for tokens per second. lmnb sent `prompt_eval_duration: 0` (a division by zero) and
    the whole time as `eval_duration`. Streamed or not, with tools or without."""
    client = ollama.Client(host=server.url, headers=AUTH)
    options = {"temperature": 0, "num_predict": 5}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    replies = [client.generate(model="tiny", prompt="Hi", options=options),
               list(client.generate(model="tiny", prompt="Hi", options=options,
                                    stream=True))[-1],
               client.chat(model="tiny", messages=CHAT, options=options),
               list(client.chat(model="tiny", messages=CHAT, options=options,
                                stream=True))[-1],
               client.chat(model="tiny", messages=CHAT, options=options, tools=[tool]),
               list(client.chat(model="tiny", messages=CHAT, options=options, tools=[tool],
                                stream=True))[-1]]
    for reply in replies:
        assert reply.done and reply.load_duration == 0
        assert reply.prompt_eval_duration > 0 and reply.eval_duration >= 0
        assert reply.prompt_eval_duration + reply.eval_duration == reply.total_duration


def test_ollama_logprobs_are_the_chat_completions_ones(server, client):
    """`logprobs` / `top_logprobs` (the client's, Ollama's `{token, logprob, bytes,
    top_logprobs}` per output token) come back on /api/generate and /api/chat, streamed (each
    object its own tokens') or not, with tools too: the same as /v1/chat/completions' for the
    same prompt; lmnb dropped them silently. `top_logprobs` over 20 is Ollama's 400."""
    llama = ollama.Client(host=server.url, headers=AUTH)
    options = {"temperature": 0, "num_predict": 5}
    asked = {"logprobs": True, "top_logprobs": 2, "options": options}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": "Hi"}]
    reference = client.chat.completions.create(model="tiny", messages=ask, temperature=0,
                                               max_tokens=5, logprobs=True, top_logprobs=2)
    expected = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in reference.choices[0].logprobs.content]
    assert len(expected) == 5

    def entries(replies: list) -> list:
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for reply in replies for e in reply.logprobs or ()]

    def same(got: list) -> bool:
        """The reference's tokens, and its logprobs up to a cache hit's rounding (a prompt
        served from the prefix cache runs another attention path than a fresh prefill)."""
        def tokens(rows: list) -> list:
            return [(token, [t for t, _ in top]) for token, _, top in rows]

        def values(rows: list) -> list:
            return [v for _, logprob, top in rows for v in (logprob, *(lp for _, lp in top))]

        return tokens(got) == tokens(expected) and values(got) == pytest.approx(
            values(expected), abs=1e-4)

    assert same(entries([llama.generate(model="tiny", prompt="Hi", **asked)]))
    assert same(entries(list(llama.generate(model="tiny", prompt="Hi", stream=True, **asked))))
    assert same(entries([llama.chat(model="tiny", messages=ask, **asked)]))
    assert same(entries(list(llama.chat(model="tiny", messages=ask, stream=True, **asked))))
    with_tools = llama.chat(model="tiny", messages=ask, tools=[tool], **asked)
    assert len(with_tools.logprobs) == with_tools.eval_count
    streamed = list(llama.chat(model="tiny", messages=ask, tools=[tool], stream=True, **asked))
    assert len(entries(streamed)) == streamed[-1].eval_count
    with pytest.raises(ollama.ResponseError) as caught:
        llama.generate(model="tiny", prompt="Hi", logprobs=True, top_logprobs=21)
    assert caught.value.status_code == 400


# ---- many streams at once ---------------------------------------------------------------------
def test_many_concurrent_streams_all_complete(server, rt):
    count, tokens = 200, 6

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int]:
        body = {"model": "tiny", "prompt": f"Request {i}:", "max_tokens": tokens,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
        events = sse_data(iter(lines))
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length"
        return "".join(e["choices"][0]["text"] for e in events if e["choices"]), (
            events[-1]["usage"]["completion_tokens"])

    async def main() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120,
                                     limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(count)))

    results = asyncio.run(main())
    assert len(results) == count and all(n == tokens for _, n in results)
    wait_idle(rt)
    rt.check_integrity()


def test_server_stops_and_port_is_free(rt):
    handle = ServerHandle.start(rt)
    url = handle.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 200  # no key configured
    handle.stop()
    assert not handle.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_cli_serves_a_model(tiny_models, monkeypatch):
    import lmnb.server
    from lmnb.__main__ import main

    calls = []

    def fake_serve(runtime, **options):  # instead of blocking in uvicorn.run
        calls.append(options)
        out = runtime.generate("Hi", {"max_new_tokens": 1})
        assert out["meta_info"]["completion_tokens"] == 1

    monkeypatch.setattr(lmnb.server, "serve", fake_serve)
    assert main(["serve", str(tiny_models["llama-gqa"]), "--port", "0", "--api-key", "k",
                 "--max-total-tokens", "512", "--device", "cpu"]) == 0
    assert calls == [{"host": "127.0.0.1", "port": 0, "api_key": "k",
                      "served_model_name": None, "max_request_bytes": 32 * 2**20,
                      "allowed_origins": ["*"], "log_level": "info"}]


def test_cli_allowed_origins_take_a_list_or_vllms_json():
    from lmnb.__main__ import build_parser

    def parsed(*argv: str) -> list[str]:
        return build_parser().parse_args(["serve", *argv]).allowed_origins

    assert parsed() == ["*"]
    assert parsed("--allowed-origins", "http://a, http://b") == ["http://a", "http://b"]
    assert parsed("--allowed-origins", '["http://a"]') == ["http://a"]
    assert parsed("--allowed-origins", "") == []


# ---- SmolLM2, where the text matters -----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[tuple[Runtime, ServerHandle]]:
    with Runtime(max_total_tokens=8192) as runtime, ServerHandle.start(runtime) as handle:
        yield runtime, handle


@pytest.mark.slow
def test_smollm2_chat_json_and_greedy_agreement(smollm2_server):
    runtime, handle = smollm2_server
    client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="x", messages=messages, temperature=0,
                                          max_tokens=30)
    assert "Paris" in chat.choices[0].message.content
    direct = runtime.generate(runtime.apply_chat_template(messages),
                              {"temperature": 0, "max_new_tokens": 30})
    assert chat.choices[0].message.content == direct["text"]
    streamed = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
        model="x", messages=messages, temperature=0, max_tokens=30, stream=True))
    assert streamed == direct["text"]
    person = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    out = client.chat.completions.create(model="x", messages=person, temperature=0,
                                         max_tokens=120,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.slow
def test_smollm2_forced_tool_call_has_the_right_arguments(smollm2_server):
    """Constrained decoding keeps the call valid; the real model fills in the right city."""
    runtime, handle = smollm2_server
    client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather], tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=40)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})


def test_runtime_closed_mid_stream_ends_the_stream(tiny_models):
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=2048)
    with ServerHandle.start(runtime) as handle, httpx.Client(base_url=handle.url,
                                                             timeout=60) as c:
        body = {"text": "Hi", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with c.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
            runtime.close()
            events = sse_data(lines)
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert c.post("/generate", json={"text": "Hi"}).status_code == 500


def test_errors_mid_stream_become_an_event():
    from lmnb.server.streams import guarded, sse, sse_error

    async def events():
        yield sse({"n": 1})
        raise RuntimeError("the scheduler failed")

    async def read() -> list[str]:
        return [event async for event in guarded(events(), sse_error)]

    out = asyncio.run(read())
    assert out[0] == 'data: {"n": 1}\n\n'
    assert json.loads(out[1].split("\n")[0][6:])["error"]["message"] == "the scheduler failed"
    assert out[1].endswith("data: [DONE]\n\n")


def test_stop_with_an_open_stream_aborts_it(rt):
    before = wait_idle(rt)["generated_tokens"]
    handle = ServerHandle.start(rt)
    body = {"text": "Hi", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "n": 8}}
    with httpx.Client(base_url=handle.url, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
            handle.stop()
            assert not handle.running
    stats = wait_idle(rt)
    assert stats["generated_tokens"] - before < 8 * 400
    rt.check_integrity()


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def test_native_generate_output_ids_after_jump_forward(http, rt):
    """`/generate`'s output_ids are the request's output ids, whole or streamed, also after a
    jump-forward re-tokenized the output (an incremental chunk then says where its ids go:
    `output_ids_from`)."""
    params = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(PERSON_SCHEMA)}
    direct = rt.generate("Person:", params)
    assert direct["meta_info"].get("jump_forward_steps", 0) > 0
    out = http.post("/generate", json={"text": "Person:", "sampling_params": params}).json()
    body = {"text": "Person:", "sampling_params": params, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert out["text"] == direct["text"]
    assert out["output_ids"] == direct["output_ids"]
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
    assert events[-1]["output_ids"] == direct["output_ids"]


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize(("tools", "tokens"), [(None, 400), (WEATHER, 300)])
def test_stop_with_an_open_chat_stream_aborts_it(rt, tools, tokens):
    """`ServerHandle.stop()` with a chat stream of n choices open, with tools or without: its
    requests are aborted and the client's connection ends. (`tokens` fit in the context after
    the prompt, its tools' schemas included.)"""
    import threading
    import time

    n = 4
    before = wait_idle(rt)["generated_tokens"]
    handle = ServerHandle.start(rt)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": tokens, "n": n,
            "ignore_eos": True, "stream": True}
    if tools:
        body.update(tools=tools, tool_choice="required")

    def client() -> None:
        try:
            with httpx.Client(base_url=handle.url, timeout=20) as c:
                with c.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
        except httpx.HTTPError:
            pass

    rt.set_batch_hook(lambda batch: time.sleep(0.02))  # the requests outlast the stop anywhere
    try:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while rt.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.stats()["running"] > 0
        handle.stop()
        thread.join(10)
    finally:
        rt.set_batch_hook(None)
    client_ended = not thread.is_alive()  # the server closed the connection
    stats = wait_idle(rt)
    generated = stats["generated_tokens"] - before
    rt.check_integrity()
    assert generated < n * tokens * 0.9, generated
    assert client_ended, "the client still waits on a connection the stopped server left open"
