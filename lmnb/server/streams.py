"""How a route drives the runtime: open an `OutputStream` off the event loop, read it with
`async for`, and abort its requests when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lmnb.runtime.output import OutputStream
from lmnb.runtime.prompts import PromptInput
from lmnb.runtime.request_checks import SamplingInput
from lmnb.runtime.surface import EngineSurface
from lmnb.server.limits import check_prompt_size
from lmnb.server.request_streams import Closable, own

Chunk = dict[str, Any]


ServedRuntime = EngineSurface  # what the server uses of `lmnb.Runtime` (or a DP runtime)


async def open_stream(runtime: ServedRuntime, prompt: PromptInput = None,
                      sampling_params: SamplingInput = None, **kwargs: Any) -> OutputStream:
    """`runtime.generate(..., stream=True)` on a worker thread (tokenizing and building a grammar
    must not block the loop). Cancelled while it runs, the stream it returns is closed; else
    the stream is closed at the latest when the request's handling ends (`RequestStreams`)."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, partial(_generate, runtime, prompt, sampling_params,
                                                kwargs))
    try:
        return own(await asyncio.shield(future))
    except asyncio.CancelledError:
        future.add_done_callback(_close_result)
        raise


def _generate(runtime: ServedRuntime, prompt: PromptInput, sampling_params: SamplingInput,
              kwargs: dict[str, Any]) -> OutputStream:
    check_prompt_size(runtime, prompt, kwargs.get("input_ids"))  # before tokenizing it all
    return runtime.generate(prompt, sampling_params, stream=True, **kwargs)


def _close_result(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


@contextlib.asynccontextmanager
async def closed_on_disconnect(request: Request, stream: Closable) -> AsyncIterator[None]:
    """While the block runs, a client disconnect closes `stream` (aborting its requests); the
    stream is closed when the block ends in any way."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.close()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        stream.close()


async def collect(request: Request, stream: OutputStream) -> list[Chunk]:
    """Every request's whole result, in order (`text`, `output_ids`, last `meta_info`); stops
    early, aborting the requests, when the client disconnects."""
    async with closed_on_disconnect(request, stream):
        return await stream.aresults()


async def chunks(stream: OutputStream) -> AsyncIterator[Chunk]:
    """The stream's chunks; leaving early (a disconnect cancels the response task, or the
    generator is closed) closes the stream, which aborts unfinished requests."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        stream.close()


def chunk_index(chunk: Chunk) -> int:
    return chunk.get("index", 0)


def finish_type(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def matched_stop(meta: dict[str, Any]) -> int | str | None:
    """SGLang's `matched_stop`: the stop string or token id that ended the request, else None."""
    reason = meta.get("finish_reason")
    return reason.get("matched") if isinstance(reason, dict) else None


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; `data` as JSON unless it is a string already."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


async def guarded(events: AsyncIterator[str],
                  on_error: Callable[[Exception], str]) -> AsyncGenerator[str, None]:
    """`events`, ending with `on_error(error)`'s text when the runtime fails mid-stream (the
    status line is sent already, so the error travels in the body)."""
    try:
        async for event in events:
            yield event
    except Exception as error:  # a closed or failed runtime, a tokenizer error
        yield on_error(error)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class EventStream(StreamingResponse):
    """A streamed response of `guarded` events, closed when the response ends however it
    ended: Starlette leaves a body cancelled mid-write (the client left while a write waited)
    suspended at a `yield`, for the garbage collector to close, so the streams it reads and
    the rids it holds (`OpenRequests`) would stay open until then."""

    body_iterator: AsyncGenerator[str, None]

    def __init__(self, events: AsyncIterator[str], on_error: Callable[[Exception], str], *,
                 media_type: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(guarded(events, on_error), media_type=media_type, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_error(error: Exception) -> str:
    """OpenAI's and SGLang's in-stream error, then the end marker."""
    return sse({"error": {"message": str(error), "type": type(error).__name__,
                          "param": None, "code": None}}) + sse("[DONE]")
