"""Anthropic's Messages API over the runtime: `/v1/messages`, whole or as its server-sent
events (message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from lmnb.server.limits import check_prompt_size
from lmnb.server.messages import text_content
from lmnb.server.streams import ServedRuntime, chunks, collect, guarded, open_stream, sse


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False


def _stop_reason(meta: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    reason = meta.get("finish_reason") or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(meta: dict[str, Any], output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's meaning: `input_tokens` are the prompt tokens not read from the cache."""
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta.get("prompt_tokens", 0) - cached,
            "output_tokens": (meta.get("completion_tokens", 0) if output_tokens is None
                              else output_tokens),
            "cache_read_input_tokens": cached}


def _error_event(error: Exception) -> str:
    return sse({"type": "error", "error": {"type": "api_error", "message": str(error)}},
               event="error")


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Any:
        chat = []
        if body.system:
            chat.append({"role": "system", "content": text_content(body.system,
                                                                   where="system")})
        chat += [{"role": m.get("role"),
                  "content": text_content(m.get("content"), where=f"messages.{i}.content")}
                 for i, m in enumerate(body.messages)]
        prompt = runtime.apply_chat_template(chat)
        stops = body.stop_sequences or []
        params: dict[str, Any] = {"max_new_tokens": body.max_tokens, "stop": stops}
        for key in ("temperature", "top_p", "top_k"):
            if getattr(body, key) is not None:
                params[key] = getattr(body, key)
        stream = await open_stream(runtime, prompt, params)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                   "model": body.model or model_name}
        if body.stream:
            return StreamingResponse(guarded(_events(stream, message, stops), _error_event),
                                     media_type="text/event-stream")
        (result,) = await collect(request, stream)
        meta = result["meta_info"]
        stop_reason, stop_sequence = _stop_reason(meta, stops)
        return {**message, "content": [{"type": "text", "text": result["text"]}],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(meta)}

    return router


async def _events(stream: Any, message: dict[str, Any], stops: list[str]) -> AsyncIterator[str]:
    started = False
    output_tokens = 0
    async for chunk in chunks(stream):
        meta = chunk["meta_info"]
        output_tokens += len(chunk["output_ids"])
        if not started:
            started = True
            yield sse({"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": _usage(meta, 0)}}, event="message_start")
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
                       "usage": {"output_tokens": meta.get("completion_tokens",
                                                           output_tokens)}},
                      event="message_delta")
            yield sse({"type": "message_stop"}, event="message_stop")


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`'s body: a Messages request without the sampling fields."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def count_tokens_router(runtime: ServedRuntime) -> APIRouter:
    """`POST /v1/messages/count_tokens` -> `{"input_tokens": n}`: the tokens of the prompt
    that `/v1/messages` builds from the same system, messages and tools (its `usage` splits
    them into `input_tokens` and `cache_read_input_tokens`)."""
    router = APIRouter()

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        chat = []
        if body.system:
            chat.append({"role": "system", "content": text_content(body.system,
                                                                   where="system")})
        chat += [{"role": m.get("role"),
                  "content": text_content(m.get("content"), where=f"messages.{i}.content")}
                 for i, m in enumerate(body.messages)]
        tools = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {})}} for tool in body.tools or ()]
        prompt = runtime.apply_chat_template(chat, tools=tools or None)
        return {"input_tokens": await asyncio.to_thread(_count_tokens, runtime, prompt)}

    return router


def _count_tokens(runtime: ServedRuntime, prompt: str) -> int:
    check_prompt_size(runtime, prompt)
    return len(runtime.encode(prompt))
