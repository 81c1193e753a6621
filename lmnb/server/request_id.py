"""A request id on every response, under the name each API gives it: OpenAI's `x-request-id`
(the `openai` client keeps it as a response's `_request_id` and in its errors) and Anthropic's
`request-id` (the `anthropic` SDK's `_request_id`, `MessageStream.request_id` and its errors'
`request_id`), one id for both: the client's own `X-Request-Id` echoed when it is short
printable ASCII (as vLLM's `--enable-request-id-headers`), else a new `req_...`."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
HEADERS = (HEADER, b"request-id")  # OpenAI's, Anthropic's
MAX_LENGTH = 128


def _given(value: bytes | None) -> bytes | None:
    if value is None or not 0 < len(value) <= MAX_LENGTH:
        return None
    return value if all(0x20 < byte < 0x7F for byte in value) else None


class RequestId:
    """ASGI middleware adding `x-request-id` and `request-id` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (_given(dict(scope["headers"]).get(HEADER))
                      or f"req_{uuid.uuid4().hex}".encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() not in HEADERS]
                message = {**message, "headers": [*headers,
                                                  *((name, request_id) for name in HEADERS)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
