"""Anthropic's Messages API over the runtime: `/v1/messages`, whole or as its server-sent
events (message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop). With `tools`, calls come as `tool_use` blocks (streamed as
`input_json_delta`s) and `stop_reason: "tool_use"`. `output_config.format` (structured outputs)
constrains the text to its JSON schema. `image` blocks (base64), in a turn or in a
`tool_result`, go to a LLaVA model as OpenAI's `image_url` parts do."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from lmnb.runtime.output import OutputStream
from lmnb.server.errors import APIError
from lmnb.server.limits import check_prompt_size
from lmnb.server.media import chat_media
from lmnb.server.messages import anthropic_chat
from lmnb.server.streams import (
    EventStream,
    ServedRuntime,
    chunks,
    closed_on_disconnect,
    collect,
    finish_type,
    open_stream,
    sse,
)
from lmnb.server.tool_run import ChoiceResult, ToolRun
from lmnb.server.tools import (
    ArgumentsDelta,
    CallStream,
    ToolPlan,
    anthropic_tool_choice,
    anthropic_tools,
    partial_object,
    tool_plan,
)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


def _output_schema(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema of `output_config.format` ({"type": "json_schema", "schema": {...}}),
    or None without a format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if not isinstance(schema, dict) or fmt.get("type") != "json_schema":
        raise APIError("output_config.format must be {\"type\": \"json_schema\", \"schema\": "
                       f"{{...}}}}, got {fmt!r}", param="output_config")
    return schema


def _stop_reason(meta: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    reason = meta.get("finish_reason") or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(meta: dict[str, Any], output_tokens: int | None = None) -> dict[str, Any]:
    """The token counts (message_delta's usage: the SDK's `MessageDeltaUsage`). Anthropic's
    meaning: `input_tokens` are the prompt tokens not read from the cache; nothing is written
    to a cache by `cache_control` (0 cache creation tokens, as Anthropic reports without it).
    A stream's message_delta carries the totals from the last meta_info (the SDK takes them
    over message_start's, which come before the cached prefix is known)."""
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta.get("prompt_tokens", 0) - cached,
            "output_tokens": (meta.get("completion_tokens", 0) if output_tokens is None
                              else output_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message_usage(meta: dict[str, Any], output_tokens: int | None = None) -> dict[str, Any]:
    """A message's usage (the SDK's `Usage`, also message_start's): the counts, their cache
    creation split by TTL (none) and the service tier (lmnb has only "standard")."""
    return {**_usage(meta, output_tokens),
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "service_tier": "standard"}


def _error_event(error: Exception) -> str:
    return sse({"type": "error", "error": {"type": "api_error", "message": str(error)}},
               event="error")


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Any:
        prompt, plan, images = _prompt(runtime, body.system, body.messages, body.tools,
                                       body.tool_choice)
        media = {"image_data": images} if images else {}
        stops = body.stop_sequences or []
        params: dict[str, Any] = {"max_new_tokens": body.max_tokens, "stop": stops}
        for key in ("temperature", "top_p", "top_k"):
            if getattr(body, key) is not None:
                params[key] = getattr(body, key)
        schema = _output_schema(body.output_config)
        if schema is not None:
            if plan is not None:
                raise APIError("output_config.format cannot be combined with tools unless "
                               "tool_choice is {\"type\": \"none\"}", param="output_config")
            params["json_schema"] = schema
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                   "model": body.model or model_name}
        if plan is not None:
            run = ToolRun(runtime, plan, prompt, params, **media)
            if body.stream:
                await run.start()  # a refused request is a 400 before the stream starts
                return EventStream(_tool_events(run, message, stops), _error_event,
                                   media_type="text/event-stream")
            async with closed_on_disconnect(request, run):
                (tool_result,) = await run.results()
            return {**message, **_tool_message(tool_result, stops)}
        stream = await open_stream(runtime, prompt, params, **media)
        if body.stream:
            return EventStream(_events(stream, message, stops), _error_event,
                               media_type="text/event-stream")
        (result,) = await collect(request, stream)
        meta = result["meta_info"]
        stop_reason, stop_sequence = _stop_reason(meta, stops)
        return {**message, "content": [{"type": "text", "text": result["text"]}],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _message_usage(meta)}

    return router


async def _events(stream: OutputStream, message: dict[str, Any],
                  stops: list[str]) -> AsyncIterator[str]:
    started = False
    output_tokens = 0
    async for chunk in chunks(stream):
        meta = chunk["meta_info"]
        output_tokens += len(chunk["output_ids"])
        if not started:
            started = True
            yield sse({"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": _message_usage(meta, 0)}}, event="message_start")
            yield sse({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}},
                      event="content_block_start")
            yield sse({"type": "ping"}, event="ping")
        if chunk["text"]:
            yield sse({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": chunk["text"]}},
                      event="content_block_delta")
        if meta.get("finish_reason") is not None:
            stop_reason, stop_sequence = _stop_reason(meta, stops)
            yield sse({"type": "content_block_stop", "index": 0}, event="content_block_stop")
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": _usage(meta, meta.get("completion_tokens", output_tokens))},
                      event="message_delta")
            yield sse({"type": "message_stop"}, event="message_stop")


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tool_stop(meta: dict[str, Any], calls: int, stops: list[str]) -> tuple[str, str | None]:
    """`tool_use` when the reply made calls and stopped of itself; a call cut by max_tokens or
    an abort ends as a reply without calls does."""
    if calls and finish_type(meta) == "stop":
        return "tool_use", None
    return _stop_reason(meta, stops)


def _tool_message(result: ChoiceResult, stops: list[str]) -> dict[str, Any]:
    """Content blocks (text, then a `tool_use` per call: the last one incomplete when
    max_tokens cut it, as its stream has it), stop reason and usage."""
    calls = result.calls
    content: list[dict[str, Any]] = []
    if result.text or not calls:
        content.append({"type": "text", "text": result.text})
    content += [{"type": "tool_use", "id": _tool_use_id(), "name": c.name,
                 "input": json.loads(c.arguments) if c.complete
                 else partial_object(c.arguments)} for c in calls]
    stop_reason, stop_sequence = _tool_stop(result.meta, len(calls), stops)
    return {"content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _message_usage(result.meta)}


async def _tool_events(run: ToolRun, message: dict[str, Any], stops: list[str]
                       ) -> AsyncIterator[str]:
    """`_events` with tools: blocks open as their content comes (a text block for text, a
    `tool_use` block per call with its arguments as `input_json_delta`s)."""
    calls = CallStream(run.plan.format)
    block, kind = -1, ""  # the open block's index and type ("" when none is open)

    def start(new_kind: str, content_block: dict[str, Any]) -> list[str]:
        nonlocal block, kind
        events = [sse({"type": "content_block_stop", "index": block},
                      event="content_block_stop")] if kind else []
        block, kind = block + 1, new_kind
        return events + [sse({"type": "content_block_start", "index": block,
                              "content_block": content_block}, event="content_block_start")]

    def delta(body: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": block, "delta": body},
                   event="content_block_delta")

    started = False
    async with aclosing(run.pieces()) as pieces:
        async for piece in pieces:
            if not started:
                started = True
                yield sse({"type": "message_start", "message": {
                    **message, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": _message_usage(piece.meta, 0)}}, event="message_start")
                yield sse({"type": "ping"}, event="ping")
            if piece.text:
                if kind != "text":
                    for event in start("text", {"type": "text", "text": ""}):
                        yield event
                yield delta({"type": "text_delta", "text": piece.text})
            for call in calls.feed(piece.calls):
                if isinstance(call, ArgumentsDelta):
                    yield delta({"type": "input_json_delta", "partial_json": call.text})
                    continue
                for event in start("tool_use", {"type": "tool_use", "id": _tool_use_id(),
                                                "name": call.name, "input": {}}):
                    yield event
            if piece.done:
                if not kind:
                    for event in start("text", {"type": "text", "text": ""}):
                        yield event
                yield sse({"type": "content_block_stop", "index": block},
                          event="content_block_stop")
                stop_reason, stop_sequence = _tool_stop(piece.meta, len(calls.calls), stops)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": _usage(piece.meta)},
                          event="message_delta")
                yield sse({"type": "message_stop"}, event="message_stop")


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`'s body: a Messages request without the sampling fields."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _prompt(runtime: ServedRuntime, system: str | list[dict[str, Any]] | None,
            messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            tool_choice: dict[str, Any] | None) -> tuple[str, ToolPlan | None, list[str]]:
    """The prompt `/v1/messages` generates from (and `count_tokens` counts), its tool plan and
    its images (data URLs, in prompt order). A last assistant message of text is a prefill:
    the reply continues it, so the earlier turns are rendered with the generation prompt and
    its text follows."""
    takes_images = runtime.model_config.image_token_id is not None
    chat, images = chat_media(anthropic_chat(system, messages, takes_images=takes_images),
                              takes_images=takes_images)
    parsed = anthropic_tools(tools)
    plan = tool_plan(parsed, anthropic_tool_choice(tool_choice, parsed), runtime.tokenizer)
    prompt_tools = plan.prompt_tools() if plan else None
    last = chat[-1] if chat else {}
    if (last.get("role") == "assistant" and not last.get("tool_calls")
            and isinstance(last.get("content"), str)):
        return (runtime.apply_chat_template(chat[:-1], tools=prompt_tools) + last["content"],
                plan, images)
    return runtime.apply_chat_template(chat, tools=prompt_tools), plan, images


def count_tokens_router(runtime: ServedRuntime) -> APIRouter:
    """`POST /v1/messages/count_tokens` -> `{"input_tokens": n}`: the tokens of the prompt
    that `/v1/messages` builds from the same system, messages and tools (its `usage` splits
    them into `input_tokens` and `cache_read_input_tokens`)."""
    router = APIRouter()

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        prompt, _, _ = _prompt(runtime, body.system, body.messages, body.tools,
                               body.tool_choice)
        return {"input_tokens": await asyncio.to_thread(_count_tokens, runtime, prompt)}

    return router


def _count_tokens(runtime: ServedRuntime, prompt: str) -> int:
    check_prompt_size(runtime, prompt)
    return len(runtime.encode(prompt))
