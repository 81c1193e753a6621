"""`x-request-id` on every response, as OpenAI's API sends it (the `openai` client keeps it as a
response's `_request_id` and in its errors): the client's own `X-Request-Id` echoed when it is
short printable ASCII (as vLLM's `--enable-request-id-headers`), else a new `req_...`."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LENGTH = 128


def _given(value: bytes | None) -> bytes | None:
    if value is None or not 0 < len(value) <= MAX_LENGTH:
        return None
    return value if all(0x20 < byte < 0x7F for byte in value) else None


class RequestId:
    """ASGI middleware adding `x-request-id` to every HTTP response."""

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
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
