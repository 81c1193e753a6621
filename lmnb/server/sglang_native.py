"""SGLang's native API over the runtime, field for field: `/generate`, `/get_model_info`,
`/get_server_info`, `/flush_cache`, `/health`, `/health_generate`.

`/generate` streams like SGLang's default: every event carries the text and ids so far
(cumulative), `meta_info` with the counts so far, `index` for batch requests, then
`data: [DONE]`. Logprobs are `[logprob, token_id, text or None]` triples (text with
`return_text_in_logprobs`); `max_new_tokens` 0 with `top_logprobs_num` k gives one
`output_top_logprobs` row, the next token's top k. `sampling_params` takes every name of SGLang
0.5's (`lmnb.params`): unimplemented ones only with their defaults, else a 400 naming them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts
from lmnb.runtime.output.stream import extend_output_ids
from lmnb.server.errors import APIError
from lmnb.server.media import media_kwargs, media_tokens
from lmnb.server.streams import (
    Chunk,
    ServedRuntime,
    chunk_index,
    chunks,
    collect,
    guarded,
    open_stream,
    sse,
    sse_error,
)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    return_token_origins: bool = False  # lmnb's: where each token came from (token_origins.py)
    rid: str | list[str] | None = None
    image_data: Any = None  # per prompt one item or a list: path, data: URL or base64
    video_data: Any = None


def sglang_meta(meta: dict[str, Any], token_text: TokenTexts | None) -> dict[str, Any]:
    """The runtime's meta_info with logprobs as SGLang's triples (text None unless
    `token_text` is given)."""
    return with_token_texts(meta, token_text or _no_text)


def _no_text(token_id: int) -> None:
    return None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()
    token_text = TokenTexts(runtime.tokenizer)

    @router.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        if (body.text is None) == (body.input_ids is None):
            raise APIError("give exactly one of text or input_ids", param="text")
        batch = isinstance(body.text, list) or bool(
            body.input_ids and isinstance(body.input_ids[0], list))
        stream = await open_stream(
            runtime, body.text, body.sampling_params, input_ids=body.input_ids,
            return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
            top_logprobs_num=body.top_logprobs_num,
            **({"return_token_origins": True} if body.return_token_origins else {}),
            **media_kwargs(body.image_data, body.video_data))
        texts = token_text if body.return_text_in_logprobs else None
        if body.stream:
            return StreamingResponse(guarded(_events(stream, batch, texts), sse_error),
                                     media_type="text/event-stream")
        results = [{**r, "meta_info": sglang_meta(r["meta_info"], texts)}
                   for r in await collect(request, stream)]
        return results if batch or len(results) > 1 else results[0]

    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = runtime.model_config
        return {"model_path": str(runtime.model_dir), "tokenizer_path": str(runtime.model_dir),
                "served_model_name": model_name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": config.image_token_id is not None,
                **media_tokens(runtime),
                "has_audio_understanding": False, "model_type": config.model_type,
                "architectures": [config.architecture] if config.architecture else None}

    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = await asyncio.to_thread(runtime.stats)
        from lmnb import __version__

        return _jsonable({**dataclasses.asdict(runtime.engine_config),
                          "served_model_name": model_name, "version": __version__,
                          "max_total_num_tokens": runtime.max_total_tokens,
                          "context_length": runtime.context_len, "internal_states": [stats]})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.to_thread(runtime.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n",
                                 status_code=400)

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        try:
            stream = await open_stream(runtime, None, {"max_new_tokens": 1, "temperature": 0},
                                       input_ids=[0])
            await collect(request, stream)
        except Exception:  # a failed or closed runtime
            return Response(status_code=503)
        return Response(status_code=200)

    return router


async def _events(stream: Any, batch: bool, token_text: TokenTexts | None) -> AsyncIterator[str]:
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    async for chunk in chunks(stream):
        index = chunk_index(chunk)
        texts[index] = texts.get(index, "") + chunk["text"]
        extend_output_ids(ids.setdefault(index, []), chunk)
        meta = sglang_meta(chunk["meta_info"], token_text)
        meta.setdefault("completion_tokens", len(ids[index]))
        out: Chunk = {"text": texts[index], "output_ids": list(ids[index]), "meta_info": meta}
        if batch or "index" in chunk:
            out["index"] = index
        yield sse(out)
    yield sse("[DONE]")
