"""Chat messages from any of the served APIs to the `{role, content: str}` dicts the runtime's
chat template takes."""

from __future__ import annotations

from typing import Any

from lmnb.server.errors import APIError


def text_content(content: Any, *, where: str = "content") -> str:
    """A message's content as text: a string, or a list of text parts (`{"type": "text",
    "text": ...}`); other parts (images, tool results) are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(f"{where}: content parts of type {kind!r} are not supported; "
                               "only text", param=where)
        return "".join(texts)
    raise APIError(f"{where} must be a string or a list of text parts", param=where)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages with their content flattened to text (other keys kept)."""
    if not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    return [{**m, "content": text_content(m.get("content"), where=f"messages.{i}.content")}
            for i, m in enumerate(messages)]
