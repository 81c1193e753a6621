"""Tool calling on the server, driven by the real clients (`openai`, `anthropic`, LangChain's
`ChatOpenAI.bind_tools`): calls are generated under their functions' schemas, so they are valid
even from the random-weight tiny model. `auto` needs the model to start a call by itself, which
random weights never do: a scripted runtime (the real one, whose first phase is made to write a
given text) stands in for a model that does."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from lmnb.runtime.chat import apply_chat_template
from lmnb.runtime.engine import Runtime
from lmnb.server import ServerHandle
from lmnb.server.tools import (
    HERMES,
    LLAMA3_JSON,
    CallStream,
    Tool,
    ToolChoice,
    ToolPlan,
    call_format,
    parse_calls,
    partial_object,
)
from tests.idle import GUARD_S, wait_idle

KEY = "sk-tools"
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {name[4:]}.",
                                           "parameters": schema}}
         for name, schema in PARAMS.items()]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]

# A template with tools of its own, in Llama-3's JSON call format.
LLAMA3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nAnswer a call as {\"name\": function name, "
    "\"parameters\": its arguments}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}"
    "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def valid_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, PARAMS[name])
    return args


class ScriptedRuntime:
    """`rt` behind another tokenizer (chat template) and with a scripted `auto` first phase: a
    request that stops on `marker` is constrained to `script` (a regex)."""

    def __init__(self, rt: Runtime, *, tokenizer: Any, marker: str, script: str) -> None:
        self.rt, self.tokenizer, self.marker, self.script = rt, tokenizer, marker, script
        self.context_len, self.max_total_tokens = rt.context_len, rt.max_total_tokens
        self.model_config, self.engine_config = rt.model_config, rt.engine_config
        self.model_dir = rt.model_dir

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        params = dict(sampling_params or {})
        if self.marker in params.get("stop", ()) and "regex" not in params:
            params["regex"] = self.script
        return self.rt.generate(prompt, params, **kwargs)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, *,
                            tools: Any = None, template_kwargs: Any = None) -> str:
        return apply_chat_template(self.tokenizer, messages,
                                   add_generation_prompt=add_generation_prompt, tools=tools,
                                   template_kwargs=template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.rt.encode(text)

    def stats(self) -> dict[str, Any]:
        return self.rt.stats()

    def flush_cache(self) -> bool:
        return self.rt.flush_cache()


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


def scripted_client(runtime: ScriptedRuntime) -> tuple[ServerHandle, openai.OpenAI]:
    handle = ServerHandle.start(runtime, served_model_name="tiny")
    return handle, openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)


def streamed(events: list) -> tuple[str, list[dict], str | None]:
    """(content, calls {id, name, arguments}, finish reason) from chat completion chunks."""
    content, calls, finish = "", [], None
    for event in events:
        if not event.choices:
            continue
        choice = event.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            if call.index == len(calls):
                assert call.id and call.function.name and call.type == "function"
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            else:
                assert call.id is None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


# ---- OpenAI ------------------------------------------------------------------------------------
def test_required_named_and_parallel_calls_are_valid(client):
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=200, n=16,
                                         temperature=1.0, seed=2)
    counts = []
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            valid_call(call.function.name, call.function.arguments)
        counts.append(len(choice.message.tool_calls))
    assert max(counts) > 1  # parallel calls happen (seeded sampling)
    assert {c.function.name for ch in out.choices for c in ch.message.tool_calls} == set(PARAMS)
    single = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, n=6, temperature=1.5, seed=2,
        parallel_tool_calls=False, tool_choice={"type": "function",
                                                "function": {"name": "get_time"}})
    for choice in single.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        valid_call("get_time", call.function.arguments)


def test_streamed_calls_equal_the_whole_response(client):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    events = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    content, calls, finish = streamed(events)
    assert events[0].choices[0].delta.role == "assistant"
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens


def logprob_chunks(client: openai.OpenAI, **kwargs: Any) -> tuple[list, list]:
    """(the whole response's logprob tokens, the streamed chunks' choices)."""
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    events = [e.choices[0] for e in client.chat.completions.create(**kwargs, stream=True)]
    return [t.token for t in whole], events


def tokens_of(choices: list) -> list[str]:
    return [t.token for c in choices if c.logprobs for t in c.logprobs.content]


def test_streamed_calls_carry_their_own_logprobs(client, rt):
    """With tools too, each chunk has the logprobs of its new tokens (all came in the last):
    a forced call, and an `auto` one whose second request's tokens follow the first's (a
    jump-forward that re-tokenizes tokens given out already cannot take them back: the
    scripted text's first token differs, the call's tokens are the whole response's)."""
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                  logprobs=True)
    whole, events = logprob_chunks(client, **kwargs, tool_choice="required")
    assert len([c for c in events if c.logprobs]) > 1 and tokens_of(events) == whole
    runtime = ScriptedRuntime(rt, tokenizer=rt.tokenizer, marker=HERMES.marker,
                              script=r"Let me look\.\n<tool_call>")
    handle, scripted = scripted_client(runtime)
    with handle:
        whole, events = logprob_chunks(scripted, **kwargs)
    first_call = next(i for i, c in enumerate(events) if c.delta.tool_calls)
    call = events[first_call + 1:]
    assert len([c for c in call if c.logprobs]) > 1
    assert tokens_of(call) == whole[-len(tokens_of(call)):]


def test_streamed_content_before_a_call_has_each_tokens_logprobs_once(tiny_models):
    """An `auto` reply's content chunk carries the logprobs of every token since the last one,
    those of chunks without text too (the byte tokens of an emoji): the first one's were lost
    and later ones given twice (OpenAI and Ollama)."""
    with Runtime(tiny_models["llama-gqa"], max_total_tokens=2048,
                 disable_jump_forward=True) as plain:  # a token at a time, jumps not in the way
        runtime = ScriptedRuntime(plain, tokenizer=plain.tokenizer, marker=HERMES.marker,
                                  script=r"🦒 ok\.\n<tool_call>")
        handle, client = scripted_client(runtime)
        with handle:
            kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=40,
                          temperature=0, logprobs=True)
            whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
            events = [e.choices[0] for e in client.chat.completions.create(**kwargs,
                                                                           stream=True)]
            llama = ollama.Client(host=handle.url)
            options = dict(model="tiny", messages=ASK, tools=TOOLS, logprobs=True,
                           options={"temperature": 0, "num_predict": 40})
            llama_whole = llama.chat(**options).logprobs
            lines = list(llama.chat(**options, stream=True))
    assert whole[0].bytes != list("🦒".encode())  # the emoji is several tokens
    for choice in events:
        if choice.delta.content:
            spelled = bytes(b for t in choice.logprobs.content for b in t.bytes)
            assert spelled.decode() == choice.delta.content
    assert [t.bytes for c in events if c.logprobs for t in c.logprobs.content] == [
        t.bytes for t in whole]
    assert [len(line.logprobs) for line in lines if line.message.content] == [
        len(c.logprobs.content) for c in events if c.delta.content]
    assert [t.token for line in lines for t in line.logprobs or ()] == [
        t.token for t in llama_whole]


def test_streamed_calls_report_continuous_usage(client):
    """`continuous_usage_stats` with tools: every chunk has the usage so far; it was ignored."""
    events = list(client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [e.usage for e in events if e.choices]
    assert usages and all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts[0] >= 1 and counts == sorted(counts), counts  # every chunk follows a token
    assert counts[-1] == events[-1].usage.completion_tokens
    assert {u.prompt_tokens for u in usages} == {events[-1].usage.prompt_tokens}


def test_auto_and_none_without_a_call_give_text(client, rt):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                             tool_choice=choice, max_tokens=8, temperature=0)
        message = out.choices[0].message
        assert message.tool_calls is None and message.content
        assert out.choices[0].finish_reason in ("stop", "length")
    # `none` leaves the tools out of the prompt; `auto` prompts with them
    assert out.usage.prompt_tokens == len(rt.encode(rt.apply_chat_template(ASK)))


def test_tool_result_round_trip(client, rt):
    wait_idle(rt, unlocked=True)
    assert rt.flush_cache()  # what the second request finds cached is the first's alone
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=120,
                                           temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    prompt = rt.apply_chat_template(history, tools=TOOLS)
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in prompt
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           max_tokens=6, temperature=0)
    assert again.choices[0].message.content and again.choices[0].message.tool_calls is None
    assert again.usage.prompt_tokens == len(rt.encode(prompt))
    # the call's turn renders as it was generated: the first prompt and the call's forced
    # opening are a cache hit (its arguments may differ from their canonical tokens: the model
    # may write `c"` as one token, the render two)
    opening = f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {{'
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + len(rt.encode(opening)) - 1
    assert cached <= first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_auto_continues_a_started_call_under_the_schema(rt):
    runtime = ScriptedRuntime(rt, tokenizer=rt.tokenizer, marker=HERMES.marker,
                              script=r"Let me look\.\n<tool_call>")
    handle, client = scripted_client(runtime)
    with handle:
        kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
        whole = client.chat.completions.create(**kwargs)
        choice = whole.choices[0]
        assert choice.message.content == "Let me look.\n"
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            valid_call(call.function.name, call.function.arguments)
        content, calls, finish = streamed(list(client.chat.completions.create(
            **kwargs, stream=True)))
        assert content == choice.message.content and finish == "tool_calls"
        assert [c["arguments"] for c in calls] == [
            c.function.arguments for c in choice.message.tool_calls]
        # both phases' tokens count; the second phase's prompt was a cache hit
        assert whole.usage.completion_tokens > len(rt.encode("Let me look.\n<tool_call>"))
        # Ollama's /api/chat: the same calls, arguments as objects, whole or streamed (sent
        # with httpx: the ollama client's Tool model drops schema keywords such as maxLength)
        body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "stream": False,
                "options": {"num_predict": 120, "temperature": 0}}
        with httpx.Client(base_url=handle.url, timeout=60) as http:
            out = http.post("/api/chat", json=body).json()
            lines = [json.loads(line) for line in http.post(
                "/api/chat", json={**body, "stream": True}).text.splitlines()]
        message = out["message"]
        assert message["content"] == choice.message.content and out["done_reason"] == "stop"
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == [
            (c.function.name, valid_call(c.function.name, c.function.arguments))
            for c in choice.message.tool_calls]
        assert "".join(line["message"]["content"] for line in lines) == message["content"]
        assert [c for line in lines for c in line["message"].get("tool_calls", ())] == (
            message["tool_calls"])
        history = [*ASK, message, {"role": "tool", "tool_name": "get_weather",
                                   "content": "22 C"}]
        reply = ollama.Client(host=handle.url).chat(model="tiny", messages=history,
                                                    tools=TOOLS, options={"num_predict": 2})
        assert reply.prompt_eval_count > out["prompt_eval_count"]


def test_llama3_json_format_from_the_template(rt):
    tokenizer = copy.copy(rt.tokenizer)
    tokenizer.chat_template = LLAMA3_STYLE_TEMPLATE
    assert call_format(tokenizer) == LLAMA3_JSON and call_format(rt.tokenizer) == HERMES
    runtime = ScriptedRuntime(rt, tokenizer=tokenizer, marker="{", script=r"\{")
    handle, client = scripted_client(runtime)
    with handle:
        kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
        auto = client.chat.completions.create(**kwargs)
        forced = client.chat.completions.create(**kwargs, tool_choice="required")
        for out in (auto, forced):
            assert out.choices[0].finish_reason == "tool_calls"
            for call in out.choices[0].message.tool_calls:
                valid_call(call.function.name, call.function.arguments)
        # text before "{": not a call, the output goes on as text
        runtime.script = r"Hi \{"
        text = client.chat.completions.create(**{**kwargs, "max_tokens": 10})
        assert text.choices[0].message.content.startswith("Hi {")
        assert text.choices[0].message.tool_calls is None


def test_langchain_bind_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: int) -> str:
        """The time in a zone."""
        return "noon"

    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                     max_tokens=60, temperature=0)
    bound = llm.bind_tools([get_time], tool_choice="any")
    message = bound.invoke("What time is it in zone 2?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_time"
    for call in message.tool_calls:
        assert isinstance(call["args"]["zone"], int)
    chunks = list(bound.stream("What time is it in zone 2?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in message.tool_calls]


# ---- Anthropic ---------------------------------------------------------------------------------
def test_anthropic_tool_use_and_result(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    tools = [{"name": name, "description": f"The {name[4:]}.", "input_schema": schema}
             for name, schema in PARAMS.items()]
    kwargs = dict(model="tiny", max_tokens=120, extra_body={"temperature": 0}, tools=tools,
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    out = client.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_weather"})
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses and all(b.name == "get_weather" for b in uses)
    for block in uses:
        valid_call(block.name, block.input)
    with client.messages.stream(**kwargs, tool_choice={"type": "tool",
                                                       "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in uses]
    assert final.stop_reason == "tool_use"
    anyone = client.messages.create(**kwargs, tool_choice={"type": "any",
                                                            "disable_parallel_tool_use": True})
    (use,) = [b for b in anyone.content if b.type == "tool_use"]
    valid_call(use.name, use.input)
    reply = client.messages.create(**{**kwargs, "max_tokens": 6, "messages": [
        *kwargs["messages"], {"role": "assistant", "content": out.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "22 C"}]}]})
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.content[0].type == "text" and reply.content[0].text
    none = client.messages.create(**kwargs, tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"]


def test_anthropic_call_cut_by_max_tokens_is_an_incomplete_tool_use(server):
    """Anthropic: a response cut by max_tokens inside a call has the incomplete tool_use block
    (stop_reason "max_tokens"); its input is the whole members so far, what the SDK reads
    from the streamed input_json_delta's. It was left out of the whole response (an empty text
    block instead) while the stream had it."""
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER_PARAMS}]
    seen = set()
    for max_tokens in range(20, 40, 2):
        kwargs = dict(model="tiny", max_tokens=max_tokens, extra_body={"temperature": 0},
                      tools=tools, tool_choice={"type": "any"},
                      messages=[{"role": "user", "content": "Weather in Paris?"}])
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert whole.stop_reason == streamed.stop_reason
        assert [(b.type, b.model_dump().get("name"), b.model_dump().get("input"))
                for b in whole.content] == [
            (b.type, b.model_dump().get("name"), b.model_dump().get("input"))
            for b in streamed.content]
        if whole.stop_reason == "max_tokens" and whole.content[-1].type == "tool_use":
            seen.add(json.dumps(whole.content[-1].input, sort_keys=True))
    assert len(seen) >= 2  # cut at more than one place in the call


# ---- Ollama ------------------------------------------------------------------------------------
def test_ollama_chat_tools_reach_the_prompt(server):
    """The `ollama` client's `tools` on /api/chat are in the prompt (and calls can come back:
    `test_auto_continues_a_started_call_under_the_schema`), not silently dropped."""
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    plain = client.chat(model="tiny", messages=ASK, options={"num_predict": 1})
    with_tools = client.chat(model="tiny", messages=ASK, tools=TOOLS,
                             options={"num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count


def test_ollama_chat_format_with_tools_follows_the_format(server):
    """Ollama takes `format` with `tools`: the tools are described in the prompt and the reply
    follows the format (its runner constrains the whole output), streamed or not; lmnb
    answered a 400."""
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
              "required": ["city"]}
    options = {"num_predict": 40, "temperature": 0}
    shaped = client.chat(model="tiny", messages=ASK, format=schema, options=options)
    reply = client.chat(model="tiny", messages=ASK, tools=TOOLS, format=schema, options=options)
    assert reply.done_reason == "stop" and not reply.message.tool_calls
    jsonschema.validate(json.loads(reply.message.content), schema)
    assert reply.prompt_eval_count > shaped.prompt_eval_count  # the tools are in the prompt
    lines = list(client.chat(model="tiny", messages=ASK, tools=TOOLS, format=schema,
                             options=options, stream=True))
    assert lines[-1].done and not any(line.message.tool_calls for line in lines)
    assert "".join(line.message.content for line in lines) == reply.message.content


def test_ollama_chat_tools_within_a_small_num_ctx(server, rt):
    """A chat with tools longer than its `num_ctx` is cut as any other (its first `num_keep`
    tokens and its end) and its reply, calls included, ends within the window."""
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(300))}]
    size = 96
    assert len(rt.encode(rt.apply_chat_template(long, tools=TOOLS))) > size
    for stream in (False, True):
        reply = client.chat(model="tiny", messages=long, tools=TOOLS, stream=stream,
                            options={"num_ctx": size, "temperature": 0})
        if stream:
            *_, reply = reply
        assert reply.done and reply.prompt_eval_count < size
        assert reply.prompt_eval_count + reply.eval_count <= size
    rt.check_integrity()


def digits_tool(items: int) -> dict:
    """A function whose call takes over `items` tokens: `items` digits or more."""
    return {"type": "function", "function": {"name": "digits", "parameters": {
        "type": "object", "properties": {"d": {"type": "array", "minItems": items, "items": {
            "type": "integer", "minimum": 0, "maximum": 9}}}, "required": ["d"]}}}


def test_disconnect_mid_call_frees_kv(rt):
    """A client gone while continuations generate calls aborts them: they would run for over
    `items` decode steps each (up to the tiny model's context), the client leaves after ~5."""
    runtime = ScriptedRuntime(rt, tokenizer=rt.tokenizer, marker=HERMES.marker,
                              script=r"<tool_call>")
    samples, items = 3, 150
    digits = digits_tool(items)
    before = wait_idle(rt, 30.0, unlocked=True)["generated_tokens"]
    body = {"model": "tiny", "messages": ASK, "tools": [digits], "max_tokens": 4 * items,
            "stream": True, "n": samples}
    with ServerHandle.start(runtime) as handle, httpx.Client(base_url=handle.url,
                                                             timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"tool_calls"' in line:
                    break
    stats = wait_idle(rt, 30.0, unlocked=True)
    # Each sample would write over `items` tokens; aborted, they stop short however loaded the
    # machine is (2 cores under the whole suite: ~190 tokens in all before the abort landed).
    assert stats["generated_tokens"] - before < samples * items
    rt.check_integrity()


class HeldContinuations(ScriptedRuntime):
    """A `ScriptedRuntime` whose second requests (a started call's continuation) are sent only
    once `release` is set; `reached` is set when one waits."""

    def __init__(self, rt: Runtime, **script: Any) -> None:
        super().__init__(rt, **script)
        self.reached, self.release = threading.Event(), threading.Event()

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        if self.marker not in (sampling_params or {}).get("stop", ()):
            self.reached.set()
            assert self.release.wait(GUARD_S), "the test never released the continuation"
        return super().generate(prompt, sampling_params, **kwargs)


def test_abort_all_aborts_a_continuation_opened_after_it(rt):
    """`/abort_request {"abort_all": true}` while a call's first request has ended and its
    continuation is being opened (held here until the abort has been answered): the
    continuation is aborted as it opens, so the choice ends with finish_reason `abort` (as
    SGLang's), far short of its 250 tokens, every KV slot back. It ran to its length."""
    runtime = HeldContinuations(rt, tokenizer=rt.tokenizer, marker=HERMES.marker,
                                script=r"<tool_call>")
    tokens = 250  # fits the tiny model's context after the tools' prompt
    with ServerHandle.start(runtime) as handle, \
            httpx.Client(base_url=handle.url, timeout=60) as http, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)
        try:
            running = pool.submit(client.chat.completions.create, model="tiny", messages=ASK,
                                  tools=[digits_tool(tokens)], max_tokens=tokens)
            assert runtime.reached.wait(GUARD_S), "no continuation was opened"
            assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
        finally:
            runtime.release.set()
        out = running.result()
    assert out.choices[0].finish_reason == "abort"
    assert out.usage.completion_tokens < tokens / 2
    wait_idle(rt, 30.0, unlocked=True)
    rt.check_integrity()


# ---- bad requests ------------------------------------------------------------------------------
def test_bad_tool_requests_are_400(server, client, rt):
    bad = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "f",
                                                         "parameters": {"type": "string"}}}]},
            "tools"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"x": {"not": {}}}}}}]}, "tools"),
           ({"tools": TOOLS + TOOLS[:1]}, "tools"),
           ({"tools": TOOLS, "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "tool_choice"),
           ({"tools": TOOLS, "extra_body": {"ebnf": 'root ::= "yes" | "no"'}}, "tool_choice"),
           ({"tools": TOOLS, "extra_body": {"regex": "(yes|no)"}}, "tool_choice")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **extra)
        assert error.value.body["param"] == param, extra
        if {"response_format", "extra_body"} & extra.keys():
            assert "cannot be combined with tools" in error.value.body["message"], extra
    history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as http:
        response = http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 4, "messages": ASK,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
        assert response.status_code == 400 and "web_search" in response.json()["error"]["message"]
    assert client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                          tool_choice="required", max_tokens=60).choices
    rt.check_integrity()


# ---- the pieces, without a model ---------------------------------------------------------------
def test_plans_parse_and_stream_what_their_regexes_match():
    tools = (Tool("get_weather", "", WEATHER_PARAMS), Tool("get_time", "", TIME_PARAMS))
    for fmt, region in (
            (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": -3}}\n</tool_call>'
                     '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                     '"unit": "c"}}\n</tool_call>'),
            (LLAMA3_JSON, '{"name": "get_time", "parameters": {"zone": -3}}; {"name": '
                          '"get_weather", "parameters": {"city": "Oslo", "unit": "c"}}')):
        plan = ToolPlan(tools, ToolChoice("required"), fmt)
        assert re.fullmatch(plan.calls_regex, region)
        assert re.fullmatch(plan.rest_regex, region[len(fmt.marker):])
        single = ToolPlan(tools, ToolChoice("required", "get_time", parallel=False), fmt)
        first = region[:region.index("}}") + 2 + len(fmt.close)]
        assert re.fullmatch(single.calls_regex, first)
        assert not re.fullmatch(single.calls_regex, region)
        calls = parse_calls(region, fmt)
        assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [
            ("get_time", {"zone": -3}, True),
            ("get_weather", {"city": "Oslo", "unit": "c"}, True)]
        stream, names, arguments = CallStream(fmt), [], ["", ""]
        for i in range(0, len(region), 3):  # any chunking gives the same calls
            for event in stream.feed(region[i:i + 3]):
                if hasattr(event, "name"):
                    names.append(event.name)
                else:
                    arguments[event.index] += event.text
        assert names == ["get_time", "get_weather"]
        assert arguments == [c.arguments for c in calls]
        cut = parse_calls(region[:region.index('"unit"')], fmt)
        assert cut[-1].name == "get_weather" and not cut[-1].complete
        assert partial_object(cut[-1].arguments) == {"city": "Oslo"}
        # every prefix: the members whole so far (one-digit numbers here: a cut number reads
        # as the shorter number, as the SDK's parser reads it)
        for call in calls:
            whole = json.loads(call.arguments)
            for end in range(len(call.arguments) + 1):
                part = partial_object(call.arguments[:end])
                assert part.items() <= whole.items(), call.arguments[:end]
            assert part == whole
    assert partial_object('{"a": [1, {"b": "x"}, "y') == {"a": [1, {"b": "x"}]}
    assert partial_object('{"a": 1.') == partial_object('{"a": tr') == {}


@pytest.mark.parametrize("tools", [False, True])
def test_a_refused_streaming_request_is_a_400_with_or_without_tools(server, client, tools):
    """A request the runtime refuses (top_p > 1) is a 400 before any byte is streamed, with
    tools too (their first request is opened before the response starts), in both APIs."""
    extra = dict(tools=TOOLS, tool_choice="required") if tools else {}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, stream=True,
                                       top_p=5.0, **extra)
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    extra = dict(tools=[{"name": name, "input_schema": schema} for name, schema in PARAMS.items()],
                 tool_choice={"type": "any"}) if tools else {}
    with pytest.raises(anthropic.BadRequestError):
        with claude.messages.stream(model="tiny", max_tokens=4, messages=ASK,
                                    extra_body={"top_p": 5.0},
                                    **extra) as stream:
            stream.get_final_message()
