"""Ollama's API over the runtime: `/api/generate`, `/api/chat` (streamed as NDJSON by
default, as Ollama does), `/api/tags`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from lmnb.server.errors import APIError
from lmnb.server.messages import chat_messages
from lmnb.server.streams import (
    ServedRuntime,
    chunks,
    collect,
    finish_type,
    guarded,
    open_stream,
)

# Ollama's `options` -> SGLang's sampling parameter names.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "num_predict": "max_new_tokens", "stop": "stop", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class ChatRequest(_OllamaRequest):
    messages: list[dict[str, Any]]


def _params(body: _OllamaRequest) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, value in (body.options or {}).items():
        if key in _OPTIONS and value is not None:
            name = _OPTIONS[key]
            params[name] = value if name != "max_new_tokens" or value >= 0 else 1 << 30
    if body.format == "json":
        params["json_schema"] = {"type": "object"}
    elif isinstance(body.format, dict):
        params["json_schema"] = body.format
    elif body.format not in (None, ""):
        raise APIError("format must be 'json' or a JSON schema", param="format")
    return params


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _final(meta: dict[str, Any], started: float) -> dict[str, Any]:
    total = int((time.perf_counter() - started) * 1e9)
    return {"done": True, "done_reason": finish_type(meta) or "stop", "total_duration": total,
            "load_duration": 0, "prompt_eval_count": meta.get("prompt_tokens", 0),
            "prompt_eval_duration": 0, "eval_count": meta.get("completion_tokens", 0),
            "eval_duration": total}


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()

    async def run(request: Request, body: _OllamaRequest, prompt: str, chat: bool) -> Any:
        started = time.perf_counter()
        params = _params(body)
        params.setdefault("max_new_tokens", runtime.context_len)
        stream = await open_stream(runtime, prompt, params)
        model = body.model or model_name

        def piece(text: str) -> dict[str, Any]:
            if chat:
                return {"message": {"role": "assistant", "content": text}}
            return {"response": text}

        if body.stream:
            return StreamingResponse(guarded(_lines(stream, model, piece, started),
                                             lambda error: json.dumps({"error": str(error)})
                                             + "\n"),
                                     media_type="application/x-ndjson")
        (result,) = await collect(request, stream)
        return {"model": model, "created_at": _now(), **piece(result["text"]),
                **_final(result["meta_info"], started)}

    @router.post("/api/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        if body.raw:
            prompt = body.prompt
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            prompt = runtime.apply_chat_template(
                messages + [{"role": "user", "content": body.prompt}])
        return await run(request, body, prompt, chat=False)

    @router.post("/api/chat", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Any:
        prompt = runtime.apply_chat_template(chat_messages(body.messages))
        return await run(request, body, prompt, chat=True)

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [{"name": model_name, "model": model_name, "modified_at": _now(),
                            "size": 0, "digest": "", "details": {"format": "lmnb"}}]}

    return router


async def _lines(stream: Any, model: str, piece: Any, started: float) -> AsyncIterator[str]:
    async for chunk in chunks(stream):
        meta = chunk["meta_info"]
        line = {"model": model, "created_at": _now(), **piece(chunk["text"])}
        if meta.get("finish_reason") is not None:
            line.update(_final(meta, started))
        else:
            line["done"] = False
        yield json.dumps(line, ensure_ascii=False) + "\n"
