"""Role begin/end text from the tokenizer's own jinja chat template (a plain fallback without one).

The template is rendered with a sentinel as the message content; what precedes the sentinel is the
role's prefix and what follows is its suffix. The first message may differ (templates insert a
default system prompt or BOS there), so it is rendered separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_SENTINEL = "\x1eLMNB_CONTENT\x1e"
_FILLER = "\x1eLMNB_FILLER\x1e"


@dataclass(frozen=True)
class RoleText:
    prefix: str
    suffix: str


class ChatTemplate:
    """`role_text(role, first=...)` gives the text around a message of that role."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
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
    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

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
        if first:
            prefix = self._strip_auto_bos(prefix)
        return RoleText(prefix, suffix)

    @staticmethod
    def _history_before(role: str) -> list[dict[str, str]]:
        if role == "assistant":
            return [{"role": "user", "content": _FILLER}]
        return [{"role": "user", "content": _FILLER}, {"role": "assistant", "content": _FILLER}]

    def _strip_auto_bos(self, prefix: str) -> str:
        """The runtime's tokenizer adds BOS itself; a template's BOS text would double it."""
        bos = getattr(self.tokenizer, "bos_token", None)
        if not bos or not prefix.startswith(bos):
            return prefix
        ids = self.tokenizer.encode("a", add_special_tokens=True)
        adds_bos = bool(ids) and ids[0] == self.tokenizer.bos_token_id
        return prefix[len(bos):] if adds_bos else prefix
