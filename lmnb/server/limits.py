"""Request limits checked before the expensive work: the body's size (`BodyLimit`, HTTP 413
before anything is parsed) and a prompt's length against the context (`check_prompt_size`,
before the whole text is tokenized).

A prompt that cannot fit is refused from its length alone when it has more characters than
`context_len * max_token_bytes` (a text has at least as many UTF-8 bytes as characters, and
a token stands for at most `max_token_bytes` of them, the longest vocabulary entry: the bound
assumes, as byte-level BPE and SentencePiece do, that the tokenizer's normalizer does not
shrink text). A shorter text that is still long is judged by its first
`context_len * PROBE_CHARS_PER_TOKEN` characters, cut at a space (so that the prefix's tokens
are the text's own): when they alone are too many, the rest is never tokenized."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmnb.params import InvalidRequestError
from lmnb.server.errors import error_body

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmnb.runtime.surface import EngineSurface

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
PROBE_CHARS_PER_TOKEN = 8  # English averages ~4 characters per token
PROBE_SLACK_TOKENS = 16  # a prefix may end in a word cut differently than in the whole text


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before the app reads
    it, whether declared by Content-Length or counted as chunks arrive (chunked bodies are
    read here, up to the limit, and handed on whole). Up to twice the limit, an oversized body
    is read to its end and dropped first, so that a client that writes all of it before
    reading (httpx, the openai client) reads the 413 rather than a reset connection; a larger
    one gets the 413 at once and the connection closes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = _content_length(headers)
        if declared is not None:  # the server holds the client to it: never more body
            if declared <= self.max_bytes:
                await self.app(scope, receive, send)
                return
            drain = declared <= 2 * self.max_bytes and b"100-continue" not in headers.get(
                b"expect", b"").lower()
            await self._refuse(scope, receive, send, declared, drain=declared if drain else 0)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)  # no body
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                parts.clear()
                more = message.get("more_body", False)
                await self._refuse(scope, receive, send, None,
                                   drain=self.max_bytes if more else 0)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(parts), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int | None, *,
                      drain: int) -> None:
        """413 after reading and dropping up to `drain` more bytes of the body; `size` is the
        declared length (None: a chunked body, counted)."""
        left = drain
        while left > 0:
            chunk = await receive()
            if chunk["type"] != "http.request" or not chunk.get("more_body", False):
                break
            left -= len(chunk.get("body", b""))
        has = " is" if size is None else f" has {size:,} bytes,"
        message = (f"the request body{has} over the limit of {self.max_bytes:,} bytes (the "
                   "server's `--max-request-bytes`)")
        body = json.dumps(error_body(message, code="request_too_large",
                                     path=scope["path"])).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    if value is None or not value.strip().isdigit():
        return None  # absent, or malformed (the HTTP server refuses that itself)
    return int(value)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first gives the whole `body`, then the client's later messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


_max_token_bytes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes of text one token of `tokenizer`'s vocabulary can stand for (an
    upper bound: a byte-level BPE entry spells each byte with a character of one or two
    bytes), computed once per tokenizer (`create_app` asks first, before serving)."""
    bound = _max_token_bytes.get(tokenizer)
    if bound is None:
        bound = _max_token_bytes[tokenizer] = max(
            len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    return bound


def check_prompt_size(runtime: EngineSurface, prompt: str | Sequence[Any] | None,
                      input_ids: Sequence[Any] | None = None) -> None:
    """Raises `InvalidRequestError` for a prompt (text, texts or id lists) that cannot fit in
    `runtime.context_len` tokens, tokenizing at most a bounded prefix of a text to tell. A
    prompt that passes may still be refused by the runtime once fully tokenized; the check only
    bounds the work spent on one that is far too long."""
    context = runtime.context_len
    if input_ids:
        lists = input_ids if isinstance(input_ids[0], list | tuple) else [input_ids]
        for ids in lists:
            if isinstance(ids, list | tuple) and len(ids) >= context:
                raise InvalidRequestError(f"the prompt has {len(ids):,} tokens; the context "
                                          f"length is {context}")
    texts = [prompt] if isinstance(prompt, str) else [
        p for p in prompt or () if isinstance(p, str)]
    for text in texts:
        _check_text(runtime, text, context)


def _check_text(runtime: EngineSurface, text: str, context: int) -> None:
    most = max_token_bytes(runtime.tokenizer)
    if len(text) > context * most:
        raise InvalidRequestError(
            f"the prompt has {len(text):,} characters, more than {context} tokens of this "
            f"tokenizer (at most {most} bytes each) can hold; the context length is "
            f"{context}")
    probe = context * PROBE_CHARS_PER_TOKEN
    if len(text) <= probe:
        return
    cut = text.rfind(" ", probe // 2, probe)
    prefix = text[:cut if cut > 0 else probe]
    count = len(runtime.encode(prefix))
    if count >= context + PROBE_SLACK_TOKENS:
        raise InvalidRequestError(
            f"the prompt has more than {count - PROBE_SLACK_TOKENS:,} tokens (its first "
            f"{len(prefix):,} of {len(text):,} characters alone); the context length is "
            f"{context}")
