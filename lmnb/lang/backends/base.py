"""The protocol every backend implements, and the results it returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams


class CancelEvent(threading.Event):
    """The `cancel=` a program's executor passes its backend: an Event that also runs callbacks
    when set, so that a backend blocked on a stream wakes at once instead of polling the flag."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
            super().set()
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Runs `callback` when the event is set (now, if it is); returns its removal."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class ProgramAborted(RuntimeError):
    """The program was interrupted; its requests were aborted."""


class MediaUnsupported(RuntimeError):
    """The backend's model takes no images (or no videos)."""


MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True)
class MediaInput:
    """One image or video of a program's prompt, as its backend prepared it (once: forks and
    later gens reuse it).

    `token` is the text standing for it in the prompt (the model's image or video token, e.g.
    `<image>`); `data` is what the backend sends (a preprocessed `MediaItem`, a data URL, ...)."""

    kind: str  # "image" | "video"
    token: str
    data: Any


def media_data(media: Sequence[MediaInput]) -> dict[str, list[Any]]:
    """`image_data=` / `video_data=` of one prompt's media (each kind in prompt order), as
    `Runtime.generate` and SGLang's `/generate` take them."""
    data: dict[str, list[Any]] = {}
    for item in media:
        data.setdefault(f"{item.kind}_data", []).append(item.data)
    return data


@dataclass
class Generation:
    text: str | list[str]  # a list when n > 1
    meta_info: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatPrompt:
    """The program's conversation at a `gen`, for backends whose endpoint takes messages.

    `messages` are the closed role messages; `role` is the open one (None outside roles) and
    `partial` its content written so far (text the reply must continue)."""

    messages: tuple[dict[str, str], ...]
    role: str | None
    partial: str = ""


@runtime_checkable
class Backend(Protocol):
    # Role text from the model's own template; a backend over a Runtime renders it with
    # `Runtime.apply_chat_template`, so roles and chat prompts agree.
    chat_template: ChatTemplate

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        """Continues `prompt`. `on_delta` receives text as it streams; setting `cancel` aborts
        the request and raises `ProgramAborted`. Backends of chat models (`is_chat_model` true)
        are also given `chat=ChatPrompt(...)`, the same prompt as messages.

        `meta_info` carries at least `finish_reason` (`{"type": "stop" | "length", ...}`) and
        `completion_tokens` when the backend knows them (API speculation relies on both)."""
        ...

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        """The chosen continuation and its scores."""
        ...

    def cache_prefix(self, prompt: str) -> None:
        """Hint: `prompt` will be shared by several continuations."""
        ...


@runtime_checkable
class MediaBackend(Backend, Protocol):
    """A backend whose model takes images and videos (LLaVA). Its `generate`, `select` and
    `cache_prefix` also take `media=` (a sequence of `MediaInput`, in prompt order), passed only
    when the prompt has media; every media's `token` is in the prompt text where it goes."""

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        """Loads (and hashes, preprocesses) one image or video for this backend's model; raises
        `MediaUnsupported` when the model takes no such media, `ValueError` for bad media."""
        ...
