"""`TextOnlyFake`: the `Backend` protocol's members that model-less test backends share (no chat
endpoint, no token texts, no media, prefix hints ignored); a fake adds its `generate` and
`select` (or `agenerate`/`aselect`)."""

from __future__ import annotations

from typing import Any

from lmnb.lang.backends.base import MediaInput, MediaUnsupported
from lmnb.lang.chat_template import ChatTemplate


class TextOnlyFake:
    is_chat_model = False
    reports_token_texts = False

    def __init__(self, chat_template: ChatTemplate | None = None) -> None:
        self.chat_template = chat_template or ChatTemplate(None)

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        raise MediaUnsupported(f"{type(self).__name__} is text-only")

    def cache_prefix(self, prompt: str) -> None:
        pass
