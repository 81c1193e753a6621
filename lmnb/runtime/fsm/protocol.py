"""The seam between a request's output constraint and the scheduler/sampler: `Grammar`.

Two backends implement it: lmnb's compressed FSM (`grammar.RequestGrammar`, regex and JSON schema,
masks cached per state, jump-forward from the FSM) and xgrammar (`xgrammar_backend.XGrammarMatcher`:
EBNF, and regex / JSON schema with `grammar_backend="xgrammar"`). `factory.GrammarFactory` picks one
per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class Grammar(Protocol):
    """One request's place in its constraint. The scheduler asks for the mask of the next token,
    then advances by the token it sampled (never by a stop token: those end the request first).

    Stop ids are allowed exactly when the text so far is complete, or at a dead end (nothing else
    continues it), so that the request ends instead of the batch failing. After an advance,
    `is_final` means the output can only end here, `is_dead` that the text left the constraint;
    either ends the request."""

    def bitmask(self, stop_ids: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Packed int32 [ceil(vocab / 32)] allowed next tokens on `device` (see
        sampling.bitmask); shared, callers must not modify it."""
        ...

    def advance(self, token_id: int) -> None:
        ...

    def advance_text(self, text: str) -> None:
        """Advances by `text` (what jump-forward appended), whatever tokens spell it."""
        ...

    @property
    def is_final(self) -> bool:
        ...

    @property
    def is_dead(self) -> bool:
        ...

    def fork(self) -> Grammar | None:
        """An independent copy at the same place (to walk speculative draft tokens without
        moving this one), or None when the backend cannot copy a matcher."""
        ...

    def forced_text(self) -> str:
        """Whole characters every continuation starts with ('' when the model has a choice):
        what jump-forward may append at once."""
        ...
