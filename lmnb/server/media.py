"""Images and videos in requests, as SGLang's and OpenAI's APIs carry them, for `Runtime.generate`.

SGLang's `/generate` takes `image_data` / `video_data`: one item or a list per prompt (for a
batch, a list of those or one item for every prompt), each a file path, a `data:` URL or bare
base64 (lmnb also takes a video as `{"video": ..., "num_frames": n}`). OpenAI's chat API takes
`image_url` content parts; only `data:` URLs are accepted there (nothing is fetched, and a
client does not read server files).
The runtime's media loader reads the items (bare base64 too) and gives the errors (missing file,
corrupt data, http URLs)."""

from __future__ import annotations

from typing import Any

from lmnb.server.errors import APIError
from lmnb.server.messages import chat_messages, images_refused, text_content
from lmnb.server.streams import ServedRuntime


def media_kwargs(image_data: Any, video_data: Any) -> dict[str, Any]:
    """`image_data=` / `video_data=` for `Runtime.generate`, given only when set."""
    kwargs = {}
    if image_data is not None:
        kwargs["image_data"] = image_data
    if video_data is not None:
        kwargs["video_data"] = video_data
    return kwargs


def _image_url(part: dict[str, Any], where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url[:5].lower() == "data:":
        raise APIError(f"{where}: image_url must be a data: URL (base64); lmnb fetches nothing",
                       param=where)
    return url


def _has_images(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in content)


def chat_media(messages: list[dict[str, Any]], *,
               takes_images: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """OpenAI-style messages for the chat template, and their images' data URLs in prompt
    order. A message with `image_url` parts keeps its parts (each image as `{"type": "image"}`,
    llava-hf's form, which the template writes as the image token); others are flattened to
    text as `chat_messages` does. Images for a text-only model (`takes_images` False) are
    a 400."""
    if not any(_has_images(m) for m in messages or ()):
        return chat_messages(messages), []
    if not takes_images:
        i, j = next((i, j) for i, m in enumerate(messages) if _has_images(m)
                    for j, p in enumerate(m["content"])
                    if isinstance(p, dict) and p.get("type") == "image_url")
        raise images_refused(f"messages.{i}.content.{j}")
    out, images = [], []
    for i, message in enumerate(messages):
        if not _has_images(message):
            out.extend(chat_messages([message]))
            continue
        parts = []
        for j, part in enumerate(message["content"]):
            where = f"messages.{i}.content.{j}"
            if isinstance(part, dict) and part.get("type") == "image_url":
                images.append(_image_url(part, where))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": text_content([part], where=where)})
        out.append({**message, "content": parts})
    return out, images


def media_tokens(runtime: ServedRuntime) -> dict[str, str]:
    """lmnb's additions to `/get_model_info`: `image_token` / `video_token`, the text of the
    model's media tokens (what a client writes where an image or video goes)."""
    tokens = {"image_token": runtime.image_token, "video_token": runtime.video_token}
    return {key: token for key, token in tokens.items() if token is not None}
