"""Role begin/end text from the model's own jinja chat template (a plain fallback without one).

The template is rendered with a sentinel as the message content; what precedes the sentinel is the
role's prefix and what follows is its suffix. The first message may differ (templates insert a
default system prompt there), so it is rendered separately. Rendering goes through the backend's
`render` (a Runtime's `apply_chat_template`), so roles and chat prompts share one implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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

    def __init__(self, tokenizer: Any = None, *, render: ChatRender | None = None) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.render = render or self._render_with_tokenizer
        self._role_text = lru_cache(maxsize=None)(self._compute_role_text)

    def role_text(self, role: str, *, first: bool) -> RoleText:
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown role {role!r}")
        return self._role_text(role, first)

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
        return self.render(messages, False)

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
