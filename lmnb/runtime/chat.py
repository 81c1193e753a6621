"""Chat messages to prompt text with the tokenizer's own (jinja) chat template.

The text is what `Runtime.generate(prompt)` should be given: when the tokenizer adds BOS while
encoding, a BOS that the template writes at the start is dropped, so it is not doubled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmnb.runtime.core import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError(f"message {i} must be a dict with a 'role', got {message!r}")
        if message["role"] not in _ROLES:
            raise InvalidRequestError(f"message {i} has an unknown role {message['role']!r}; "
                                      f"use one of {_ROLES}")
    return [dict(message) for message in messages]


def strip_added_bos(tokenizer: Any, text: str) -> str:
    """`text` without a leading BOS token text when encoding adds BOS anyway."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not text.startswith(bos):
        return text
    ids = tokenizer.encode("a", add_special_tokens=True)
    adds_bos = bool(ids) and ids[0] == tokenizer.bos_token_id
    return text[len(bos):] if adds_bos else text


def apply_chat_template(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]) in the tokenizer's
    template; with `add_generation_prompt`, followed by the opening of an assistant turn.
    Raises `InvalidRequestError` when the tokenizer has no template or the template rejects
    the messages (e.g. roles that do not alternate)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the tokenizer has no chat template; format the prompt "
                                  "yourself or load a model whose tokenizer has one")
    checked = _check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(checked, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja's TemplateError (raise_exception in templates) and kin
        raise InvalidRequestError(f"the chat template rejected the messages: {error}") from None
    return strip_added_bos(tokenizer, text)
