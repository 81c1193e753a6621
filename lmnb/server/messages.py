"""Chat messages from any of the served APIs to the `{role, content: str}` dicts the runtime's
chat template takes (with OpenAI's `tool_calls` and `tool` messages where calls are made)."""

from __future__ import annotations

import json
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


# OpenAI's role names that the chat template knows by another: `developer` replaced `system`
# for newer models; the runtime's chat stays strict.
OPENAI_ROLE_ALIASES = {"developer": "system"}


def _openai_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    role, content = message.get("role"), message.get("content")
    if role in OPENAI_ROLE_ALIASES:
        message = {**message, "role": OPENAI_ROLE_ALIASES[role]}
    if role == "assistant" and isinstance(content, list):
        message = {**message, "content": [
            {"type": "text", "text": part.get("refusal", "")}
            if isinstance(part, dict) and part.get("type") == "refusal" else part
            for part in content]}
    return message


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them: roles as it names them, an
    assistant's `refusal` parts (its refusal, sent back in a history) as text parts."""
    return [_openai_message(m) for m in messages]


def images_refused(where: str) -> APIError:
    """The 400 for an image sent to a text-only model, naming where the image is."""
    return APIError(f"{where}: this model takes no images (it is a text-only model); send "
                    "text parts only, or serve a vision model (LLaVA)", param=where,
                    code="images_not_supported")


def _image_part(block: dict[str, Any], where: str, takes_images: bool) -> dict[str, Any]:
    """An Anthropic image block (`source` of type base64) as OpenAI's `image_url` part with a
    data URL."""
    if not takes_images:
        raise images_refused(where)
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind != "base64" or not isinstance(source.get("data"), str):
        raise APIError(f"{where}: an image's source must be {{\"type\": \"base64\", "
                       f"\"media_type\", \"data\"}}; got source type {kind!r} (lmnb fetches "
                       "nothing)", param=where)
    media_type = source.get("media_type") or "image/png"
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,"
                                                      f"{source['data']}"}}


def _blocks_text(content: Any, where: str) -> str:
    """Anthropic's text content (a `system`, a `tool_result`'s): a string, or text blocks whose
    texts are joined by "\\n" (empty ones left out), as SGLang's endpoint joins both."""
    if not isinstance(content, list):
        return text_content(content, where=where)
    texts = [text_content([block], where=f"{where}.{i}") for i, block in enumerate(content)]
    return "\n".join(text for text in texts if text)


_THINKING = ("thinking", "redacted_thinking")  # an assistant turn's blocks of reasoning


def _is_image_url(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _tool_result(content: Any, where: str, takes_images: bool) -> str | list[dict[str, Any]]:
    """A `tool_result` block's content: its text (`_blocks_text`), or with images its text and
    `image_url` parts in order (as SGLang's endpoint gives them to the tool message)."""
    if not isinstance(content, list) or not any(
            isinstance(block, dict) and block.get("type") == "image" for block in content):
        return _blocks_text(content, where)
    return [_image_part(block, f"{where}.{k}", takes_images)
            if isinstance(block, dict) and block.get("type") == "image"
            else {"type": "text", "text": text_content([block], where=f"{where}.{k}")}
            for k, block in enumerate(content)]


def anthropic_chat(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]],
                   *, takes_images: bool) -> list[dict[str, Any]]:
    """Anthropic Messages (user and assistant turns, each with content) as OpenAI-shaped chat
    messages: `system` first, an assistant's `tool_use` blocks as its `tool_calls`, a user's
    `tool_result` blocks as `tool` messages (before the rest of that user turn), `image` blocks,
    in a turn or in a tool result, as `image_url` parts (the message keeps its parts then, for
    `lmnb.server.media.chat_media`); an assistant's thinking blocks are left out. An image for
    a text-only model (`takes_images` False) is a 400 naming its block."""
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": _blocks_text(system, "system")})
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages.{i}.content"
        if role not in ("user", "assistant"):
            raise APIError(f"messages.{i}.role must be 'user' or 'assistant', got {role!r} (the "
                           "system prompt is the top-level `system`)", param=f"messages.{i}.role")
        if not isinstance(content, (str, list)):
            raise APIError(f"{where} must be a string or a list of content blocks",
                           param=where)
        if isinstance(content, str):
            chat.append({"role": role, "content": text_content(content, where=where)})
            continue
        parts, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"),
                    "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _tool_result(block.get("content"),
                                                        f"{where}.{j}.content", takes_images)})
            elif kind in _THINKING and role == "assistant":
                continue  # as Anthropic drops earlier turns' thinking from the context
            elif kind == "image":
                parts.append(_image_part(block, f"{where}.{j}", takes_images))
            else:
                parts.append(block)
        chat.extend(results)
        if not calls and any(_is_image_url(part) for part in parts):
            chat.append({"role": role, "content": parts})
            continue
        text = text_content(parts, where=where)
        if calls:
            chat.append({"role": role, "content": text, "tool_calls": calls})
        elif text or not results:
            chat.append({"role": role, "content": text})
    return chat
