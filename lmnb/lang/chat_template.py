"""Role begin/end text from the model's own jinja chat template (a plain fallback without one).

The template is rendered with a sentinel as the message content; what precedes the sentinel is the
role's prefix and what follows is its suffix. The first message may differ (templates insert a
default system prompt there), so it is rendered separately. Rendering goes through the backend's
`render` (a Runtime's `apply_chat_template`), so roles and chat prompts share one implementation.
Templates that only read content parts (llava-hf's: `[{"type": "text", "text": ...}]`) are given
the sentinel as one text part.

Images and videos inside a role are written as the template writes an image/video content part
(`media_text`): LLaVA-1.5's template puts "<image>\n" before the text, so `user(image(x) + "Q")`
gives the prompt the model was trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (messages, add_generation_prompt) -> prompt text, e.g. `Runtime.apply_chat_template`
ChatRender = Callable[[list[dict[str, str]], bool], str]

_SENTINEL = "\x1eLMNB_CONTENT\x1e"
_FILLER = "\x1eLMNB_FILLER\x1e"


@dataclass(frozen=True)
class RoleText:
    prefix: str
    suffix: str


class ChatTemplate:
    """`role_text(role, first=...)` gives the text around a message of that role.

    `render` applies the template (default: `lmnb.runtime.chat.apply_chat_template` over
    `tokenizer`); `tokenizer` also tokenizes the end-of-turn marker."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 render: ChatRender | None = None) -> None:
        self.tokenizer = tokenizer
        self.has_template = tokenizer is not None and bool(tokenizer.chat_template)
        self.render = render or self._render_with_tokenizer
        self._role_text = lru_cache(maxsize=None)(self._compute_role_text)
        self._media_text = lru_cache(maxsize=None)(self._compute_media_text)
        self._parts: bool | None = None  # content as parts (None: not known yet)

    def role_text(self, role: str, *, first: bool) -> RoleText:
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown role {role!r}")
        return self._role_text(role, first)

    def media_text(self, kind: str, token: str) -> str:
        """The text standing for one image/video (`kind`) inside a message: what the template
        writes for such a content part when that holds the model's `token` (e.g.
        "<image>\n"), else `token` itself."""
        return self._media_text(kind, token)

    def end_of_turn(self) -> tuple[list[str], list[int]]:
        """Stop strings and stop token ids that end an assistant turn."""
        suffix = self.role_text("assistant", first=False).suffix.strip()
        if not suffix:
            return [], []
        ids = self.tokenizer.encode(suffix, add_special_tokens=False) if self.tokenizer else []
        if len(ids) == 1:
            return [], ids
        return [suffix], []

    # ---- rendering ------------------------------------------------------------------------
    def _render_with_tokenizer(self, messages: list[dict[str, str]],
                               add_generation_prompt: bool) -> str:
        from lmnb.runtime.chat import apply_chat_template

        return apply_chat_template(self.tokenizer, messages,
                                   add_generation_prompt=add_generation_prompt)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self._parts is None:
            self._parts = self._reads_parts_only()
        if self._parts:
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        for m in messages]
        return self.render(messages, False)

    def _reads_parts_only(self) -> bool:
        """Whether the template drops string content but renders a text part."""
        try:
            plain = self.render([{"role": "user", "content": _SENTINEL}], False)
            if _SENTINEL in plain:
                return False
            parts = self.render([{"role": "user", "content": [
                {"type": "text", "text": _SENTINEL}]}], False)
        except Exception:
            return False
        return _SENTINEL in parts

    def _compute_media_text(self, kind: str, token: str) -> str:
        if not self.has_template:
            return token
        text_part = {"type": "text", "text": _SENTINEL}
        try:
            without = self.render([{"role": "user", "content": [text_part]}], False)
            with_media = self.render([{"role": "user", "content": [{"type": kind}, text_part]}],
                                     False)
        except Exception:  # a template that takes no content parts
            return token
        # `with_media` must be `without` plus one inserted piece holding the token.
        head = 0
        while head < min(len(without), len(with_media)) and without[head] == with_media[head]:
            head += 1
        tail = len(without) - head
        if not with_media.endswith(without[head:]):
            return token
        inserted = with_media[head:len(with_media) - tail]
        return inserted if token in inserted and _SENTINEL not in inserted else token

    def _compute_role_text(self, role: str, first: bool) -> RoleText:
        if not self.has_template:
            return RoleText(f"{role.capitalize()}: ", "\n")
        try:
            if first:
                before, text = "", self._render([{"role": role, "content": _SENTINEL}])
            else:
                history = self._history_before(role)
                before = self._render(history)
                text = self._render([*history, {"role": role, "content": _SENTINEL}])
                if not text.startswith(before):
                    raise ValueError("the template re-renders earlier messages")
                text = text[len(before):]
        except Exception as error:  # templates may reject a role order; use the plain form
            if role == "system" and not first:
                return RoleText("", "\n")
            raise ValueError(f"the chat template cannot render a {role!r} message here: "
                             f"{error}") from error
        prefix, _, suffix = text.partition(_SENTINEL)
        return RoleText(prefix, suffix)

    @staticmethod
    def _history_before(role: str) -> list[dict[str, str]]:
        if role == "assistant":
            return [{"role": "user", "content": _FILLER}]
        return [{"role": "user", "content": _FILLER}, {"role": "assistant", "content": _FILLER}]
