"""The generation of a chat request with tools, as pieces of content text and call-region text
per choice (`lmnb.server.tools` says what a call region is).

- A forced call (`required`, a named function): one request under the plan's `calls_regex`.
- `auto`: the model writes freely, with the format's marker as an extra stop string. A choice
  that stops on it continues in a second request whose prompt is the first one's text plus the
  content and the marker (its prefix is cached), under `rest_regex`. For a format whose calls
  only start an output (Llama-3 JSON), a marker after other text is content: that choice
  continues without constraint.

The user's stop strings end content but never cut a call region. A choice's usage counts both
requests' tokens; its `max_tokens` covers both."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from lmnb.runtime.output import OutputStream
from lmnb.server.streams import ServedRuntime, chunk_index, open_stream
from lmnb.server.tools import CallStream, ParsedCall, ToolPlan

Meta = dict[str, Any]
_LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")


@dataclass(slots=True)
class Piece:
    """New text of choice `index` with the meta_info so far; `done` on the choice's last piece,
    whose meta has its usage (both requests') and finish reason. Every chunk of the runtime
    comes as a piece, one without text too: its meta has its tokens' logprob rows."""

    index: int
    meta: Meta
    text: str = ""
    calls: str = ""
    done: bool = False


@dataclass(slots=True)
class ChoiceResult:
    text: str
    calls: list[ParsedCall]
    meta: Meta


@dataclass(slots=True)
class _Continuation:
    index: int
    stream: OutputStream
    first: Meta  # the first request's last meta_info
    constrained: bool


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _merged(first: Meta, last: Meta) -> Meta:
    """The meta_info of a choice made of two requests (`last` the second's, running or last):
    its output positions follow the first's."""
    done = first.get("completion_tokens", 0)
    meta = {**last, "id": first.get("id"), "prompt_tokens": first.get("prompt_tokens", 0),
            "cached_tokens": first.get("cached_tokens", 0),
            "completion_tokens": done + last.get("completion_tokens", 0)}
    if "output_ids_from" in last:
        meta["output_ids_from"] = done + last["output_ids_from"]
    for key in _LOGPROB_LISTS:
        if key in last:
            meta[key] = list(first.get(key) or []) + list(last[key] or [])
    return meta


class ToolRun:
    """One chat request with tools (`n` choices). `pieces()` is read once; `close()` (also on a
    client disconnect) aborts every request it opened."""

    def __init__(self, runtime: ServedRuntime, plan: ToolPlan, prompt: str,
                 params: dict[str, Any], **generate_kwargs: Any) -> None:
        self.runtime, self.plan, self.prompt = runtime, plan, prompt
        self.params = dict(params)  # no regex / json_schema: the calls' regex is the constraint
        self.n = int(params.get("n", 1))
        self.generate_kwargs = generate_kwargs
        self._streams: list[OutputStream] = []
        self._first: OutputStream | None = None  # opened by `start`
        self._closed = False

    def _first_params(self) -> dict[str, Any]:
        if self.plan.forced:
            return {**self.params, "regex": self.plan.calls_regex, "stop": []}
        return {**self.params, "stop": [*_stops(self.params.get("stop")),
                                        self.plan.format.marker]}

    async def start(self) -> OutputStream:
        """Opens the first request (once; its stream): called before a streamed response starts,
        a request the runtime refuses raises here (a 400, not an error event)."""
        if self._first is None:
            self._first = await self._open(self.prompt, self._first_params())
        return self._first

    async def _open(self, prompt: str, params: dict[str, Any]) -> OutputStream:
        stream = await open_stream(self.runtime, prompt, params, **self.generate_kwargs)
        self._streams.append(stream)
        if self._closed:
            stream.close()
        return stream

    def close(self) -> None:
        self._closed = True
        for stream in self._streams:
            stream.close()

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            if self.plan.forced:
                async for chunk in await self.start():
                    meta = chunk["meta_info"]
                    yield Piece(chunk_index(chunk), meta, calls=chunk["text"],
                                done=meta.get("finish_reason") is not None)
            else:
                async with aclosing(self._auto()) as pieces:
                    async for piece in pieces:
                        yield piece
        finally:
            self.close()

    async def _auto(self) -> AsyncIterator[Piece]:
        marker = self.plan.format.marker
        stops = _stops(self.params.get("stop"))
        contents: dict[int, list[str]] = {}  # per choice, its text so far
        continuations: list[_Continuation] = []
        async for chunk in await self.start():
            index, meta = chunk_index(chunk), chunk["meta_info"]
            contents.setdefault(index, []).append(chunk["text"])
            yield Piece(index, meta, text=chunk["text"])  # without text too: its logprob rows
            reason = meta.get("finish_reason")
            if reason is None:
                continue
            limit = self.params.get("max_new_tokens")  # None: up to the context length
            left = None if limit is None else limit - meta.get("completion_tokens", 0)
            if (reason.get("type") != "stop" or reason.get("matched") != marker
                    or (left is not None and left <= 0)):
                yield Piece(index, meta, done=True)
                continue
            content = "".join(contents.get(index, ()))
            constrained = not (self.plan.format.leading_only and content.strip())
            params = {**self.params, "n": 1, "max_new_tokens": left}
            if params.get("seed") is not None:  # as sample `index` of the first request
                params["seed"] += index
            if "min_new_tokens" in params:
                params["min_new_tokens"] = max(0, params["min_new_tokens"]
                                               - meta.get("completion_tokens", 0))
            if constrained:
                params.update(regex=self.plan.rest_regex, stop=[])
                yield Piece(index, meta, calls=marker)
            else:
                params["stop"] = stops
                yield Piece(index, meta, text=marker)
            stream = await self._open(self.prompt + content + marker, params)
            continuations.append(_Continuation(index, stream, meta, constrained))
        # Each continuation was generating since it was opened; read them one after another.
        for cont in continuations:
            async for chunk in cont.stream:
                text = chunk["text"]
                yield Piece(cont.index, _merged(cont.first, chunk["meta_info"]),
                            text="" if cont.constrained else text,
                            calls=text if cont.constrained else "",
                            done=chunk["meta_info"].get("finish_reason") is not None)

    async def results(self, on_piece: Callable[[], None] | None = None) -> list[ChoiceResult]:
        """Every choice whole, in order; `on_piece()` as each piece comes (a route's clock)."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        calls = [CallStream(self.plan.format) for _ in range(self.n)]
        metas: list[Meta] = [{} for _ in range(self.n)]
        async for piece in self.pieces():
            if on_piece is not None:
                on_piece()
            texts[piece.index].append(piece.text)
            calls[piece.index].feed(piece.calls)
            if piece.done:
                metas[piece.index] = piece.meta
        return [ChoiceResult("".join(t), c.calls, m)
                for t, c, m in zip(texts, calls, metas, strict=True)]
