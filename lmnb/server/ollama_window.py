"""Ollama's context window of one request: `options.num_ctx` tokens (clamped to the model's
context length, as Ollama clamps it to the trained one), `num_keep`, and the request's
`truncate`. As Ollama's server and runner:

- a chat too long for the window drops its oldest messages first, keeping the system
  messages and always the last message (server/prompt.go `chatPrompt`);
- a prompt still longer than `size - 1` tokens keeps its first `num_keep` tokens (after a BOS
  the tokenizer adds; a negative `num_keep`: all it can) and its end, cut to leave about half
  of the rest of the window for the reply (llm/llama_server.go `completionPromptForRequest`);
  with `truncate: false` it is a 400 instead;
- the reply ends at the window's end (`done_reason: "length"`): lmnb does not shift the
  context (Ollama's `shift: false`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmnb.server.errors import APIError

DEFAULT_NUM_KEEP = 4  # Ollama's api.DefaultOptions


@dataclass(frozen=True, slots=True)
class Window:
    size: int  # tokens a prompt and its reply share
    keep: int  # num_keep
    truncate: bool

    @classmethod
    def of(cls, num_ctx: int | None, num_keep: int | None, truncate: bool,
           context_len: int) -> Window:
        """`num_ctx` unset or not positive: the whole context (Ollama's 0 is its default); a
        window holds at least a token of prompt and one of reply."""
        size = context_len if num_ctx is None or num_ctx <= 0 else min(num_ctx, context_len)
        return cls(max(size, 2), DEFAULT_NUM_KEEP if num_keep is None else num_keep, truncate)

    def messages(self, messages: list[dict[str, Any]],
                 count: Callable[[list[dict[str, Any]]], int]) -> list[dict[str, Any]]:
        """`messages` without the oldest ones the window cannot hold (`count`: the prompt
        tokens of some messages): the system messages and the last message always stay."""
        if not self.truncate:
            return messages
        for start in range(len(messages)):
            kept = [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]
            if start == len(messages) - 1 or count(kept) <= self.size:
                return kept
        return messages

    def cut(self, ids: list[int], adds_bos: bool) -> list[int]:
        """The prompt's ids as the runner feeds them: whole when they leave room for a token,
        else its first `keep` ids and its end (a 400 without `truncate`)."""
        if len(ids) < self.size:
            return ids
        if not self.truncate:
            raise APIError("the input length exceeds the context length", param="truncate")
        keep = len(ids) if self.keep < 0 else self.keep + adds_bos
        keep = min(keep, self.size - 1)
        limit = self.size - max((self.size - keep) // 2, 1)
        return ids[:keep] + ids[len(ids) - (limit - keep):]

    def max_new_tokens(self, wanted: int | None, prompt_len: int) -> int:
        """`num_predict` (None: no limit) within the room the prompt leaves (at least a token:
        a prompt re-tokenized after its cut may have grown by one)."""
        room = max(self.size - prompt_len, 1)
        return room if wanted is None else min(wanted, room)
