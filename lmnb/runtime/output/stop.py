"""Every rule that ends a request, in one place: EOS and stop token ids (after `min_new_tokens`),
stop strings, stop regexes, a finished grammar, the length limit; and where each cuts the text.

Plain functions and small classes over text and token ids (no torch, no threads), used by:
- the scheduler (`StopRules`; `stop_text.StopText` decodes the output of requests with text
  rules on the scheduler thread to apply them as soon as a match completes);
- the detokenizer (`StopStrings`: where a stop string cuts, what text to hold back meanwhile) and
  the output processor (`stopped_on_token`, `first_stop_regex_match`), which apply the same rules
  to the same text, so that the text a client sees ends where the scheduler stopped;
- the DSL's backends (`first_stop_regex_match` on what an endpoint streams, since text streamed
  before a regex match completed cannot be taken back) and API speculation (`StopStrings.first`
  on speculated text, to cut a gen exactly where a real call would stop).

Finish reasons have SGLang's shape: `{"type": "stop" | "length" | "abort", ...}`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lmnb.params import SamplingParams

if TYPE_CHECKING:
    from lmnb.runtime.fsm.protocol import Grammar

STOP_REGEX_WINDOW = 256  # characters before the new text that a stop_regex match may start in


class StopWatch(Protocol):
    """What the rules read of a request's `stop_text.StopText`."""

    @property
    def matched(self) -> str | None:
        """The stop string or regex match, once one has completed."""
        ...


# ---- finish reasons ----------------------------------------------------------------------------
def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str | None) -> dict[str, Any]:
    """`matched`: the stop string, regex match or token id; None for EOS of a grammar."""
    return {"type": "stop", "matched": matched}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


def stopped_on_token(reason: dict[str, Any] | None, ids: Sequence[int]) -> bool:
    """The request stopped on a token id (EOS or a stop id) that is the last of `ids`: that id is
    in the output ids but not in the text."""
    if reason is None or reason.get("type") != "stop" or not ids:
        return False
    matched = reason.get("matched")
    return isinstance(matched, int) and not isinstance(matched, bool) and ids[-1] == matched


# ---- text rules --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's stop strings (empty ones dropped, duplicates once). The text ends before the
    first one to complete; the detokenizer holds back a tail that may begin one."""

    strings: tuple[str, ...]
    prefixes: frozenset[str]  # proper prefixes of the strings: a tail that may still match
    max_hold: int

    @classmethod
    def of(cls, stop: Iterable[str] | None) -> StopStrings:
        strings = tuple(dict.fromkeys(s for s in stop or () if s))
        return cls(strings, frozenset(s[:k] for s in strings for k in range(1, len(s))),
                   max((len(s) - 1 for s in strings), default=0))

    def __bool__(self) -> bool:
        return bool(self.strings)

    def first(self, text: str) -> tuple[int, str] | None:
        """`(start, string)` of the match that completes first in `text` (then the one starting
        first): the result does not depend on how the text arrived in pieces."""
        best, which = (len(text) + 1, 0), None
        for s in self.strings:
            i = text.find(s)
            if i != -1 and (i + len(s), i) < best:
                best, which = (i + len(s), i), s
        return None if which is None else (best[1], which)

    def held(self, text: str) -> int:
        """Characters at the end of `text` that may begin a stop string (not streamed yet)."""
        for k in range(min(self.max_hold, len(text)), 0, -1):
            if text[-k:] in self.prefixes:
                return k
        return 0


def compile_stop_regex(patterns: Iterable[str] | None) -> list[re.Pattern]:
    """`stop_regex` patterns (checked by `lmnb.params.stop_regex_patterns`) compiled."""
    return [re.compile(p) for p in patterns or ()]


def first_stop_regex_match(patterns: Sequence[re.Pattern], text: str,
                           start: int = 0) -> re.Match | None:
    """The earliest match of any `stop_regex` pattern in `text[start:]`: the scheduler ends the
    request on it, and the text ends at its start."""
    matches = [m for m in (p.search(text, start) for p in patterns) if m is not None]
    return min(matches, key=lambda m: m.start(), default=None)


# ---- the scheduler's checks ---------------------------------------------------------------------
class StopRules:
    """The scheduler's per-token decision. Text rules apply from the first token on;
    `min_new_tokens` holds back only EOS and stop ids (the sampler masks them before)."""

    def __init__(self, eos_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def by_token(self, token: int, params: SamplingParams, output_len: int
                 ) -> dict[str, Any] | None:
        """EOS or a stop id, once `min_new_tokens` are out."""
        if output_len <= params.min_new_tokens:
            return None
        if (token in self.eos_token_ids and not params.ignore_eos) or \
                token in params.stop_token_ids:
            return finish_stop(token)
        return None

    def by_token_or_length(self, token: int, params: SamplingParams, output_len: int
                           ) -> dict[str, Any] | None:
        """`by_token`, then the length limit: every rule of a request without stop strings,
        stop regexes or a grammar (`after_text` with neither), in one call."""
        reason = self.by_token(token, params, output_len)
        if reason is not None:
            return reason
        return by_length(params, output_len)

    @staticmethod
    def after_text(stop_text: StopWatch | None, grammar: Grammar | None,
                   params: SamplingParams, output_len: int) -> dict[str, Any] | None:
        """A stop string or regex, a completed (or dead) constraint, or the length limit."""
        if stop_text is not None and stop_text.matched is not None:
            return finish_stop(stop_text.matched)
        if grammar is not None and (grammar.is_final or grammar.is_dead):
            return finish_stop(None)
        return by_length(params, output_len)


def ends_by_length_only(params: SamplingParams) -> bool:
    """Only the length limit can end it (EOS ignored; no stop ids, strings, regexes or grammar):
    unless aborted, it generates exactly `max_new_tokens` tokens."""
    return (params.ignore_eos and not params.stop_token_ids and not params.stop
            and not params.stop_regex and params.regex is None and params.json_schema is None
            and params.ebnf is None)


def by_length(params: SamplingParams, output_len: int) -> dict[str, Any] | None:
    """The length limit: `max_new_tokens` (cut to the context's room by `within_context`)."""
    if output_len >= params.max_new_tokens:
        return finish_length(output_len)
    return None


def within_context(params: SamplingParams, *, prompt_len: int,
                   context_len: int) -> SamplingParams:
    """`params` with max_new_tokens (and min_new_tokens) cut to the room that a prompt of
    `prompt_len` tokens leaves in the context, and None (no limit) made that room (`params`
    itself when it fits)."""
    room = context_len - prompt_len
    if params.max_new_tokens is not None and params.max_new_tokens <= room:
        return params
    return SamplingParams.from_dict({**params.to_dict(), "max_new_tokens": room,
                                     "min_new_tokens": min(params.min_new_tokens, room)})
