"""API speculative execution (SGLang paper, section 5).

With `@function(num_api_spec_tokens=N)`, the first `gen` of a run of gens makes one call with its
stop strings removed and `max_tokens` raised to at least N: the model keeps writing past the stop.
Later literal text must match the speculated continuation, and later `gen`s are cut from it at
their own stop, without a call. Anything that does not match (text, sampling parameters, a stop
that is not found, a token budget that cannot be proven) drops the speculation and the gen makes a
real call: speculation saves calls, it never changes an answer. A served gen's `max_tokens` is
checked against the tokens of its piece when the backend reports token texts (`OpenAI` does,
through logprobs), else against the whole speculative call's output. (It assumes, as SGLang
does, that the model's continuation depends on the text, not on how earlier output was split
into tokens.)

A `Speculation` is immutable; each program state holds its own, and a fork copies the reference.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from typing import Any

from lmnb.lang.ir import GenParams
from lmnb.runtime.output.stop import StopStrings, finish_stop

# Parameters a speculative call and the gens served from it must agree on, except these: the
# stop strings and token budget are the gen's own, checked against the speculated text instead;
# logprobs only report on the output.
_PER_GEN = ("stop", "max_new_tokens", "return_logprob", "top_logprobs_num", "logprob_start_len",
            "return_text_in_logprobs")


def can_serve(params: GenParams) -> bool:
    """Whether a gen with these parameters can be cut from speculated text: plain sampling with
    stop strings that can be found in text (no constraints, token stops, n>1, logprobs)."""
    return (
        (params.n or 1) == 1
        and params.regex is None and params.json_schema is None and params.ebnf is None
        and not params.stop_regex and not params.stop_token_ids
        and not params.return_logprob and not params.ignore_eos
        and not params.min_new_tokens
    )


def can_start(params: GenParams) -> bool:
    """Whether a gen may make a speculative call: servable and ended by a stop string."""
    return can_serve(params) and bool(params.stop)


def speculative_params(params: GenParams, num_tokens: int, *,
                       token_texts: bool = False) -> GenParams:
    """The call that continues past the gen's stop: no stop strings, at least `num_tokens`;
    with `token_texts`, it asks for logprobs, whose token texts size each served gen exactly."""
    return replace(params, stop=None, max_new_tokens=max(params.max_new_tokens or 0, num_tokens),
                   return_logprob=True if token_texts else params.return_logprob)


def _key(params: GenParams) -> GenParams:
    return replace(params, **{name: None for name in _PER_GEN})


def token_ends(text: str, meta_info: dict[str, Any]) -> tuple[int, ...] | None:
    """Where each output token ends in `text`, from `output_token_logprobs` entries
    `(logprob, id, token_text)`; None unless the token texts spell `text` exactly."""
    entries = meta_info.get("output_token_logprobs")
    if not entries:
        return None
    ends, at = [], 0
    for entry in entries:
        piece = entry[2] if isinstance(entry, list | tuple) and len(entry) > 2 else None
        if not isinstance(piece, str):
            return None
        at += len(piece)
        ends.append(at)
    return tuple(ends) if at == len(text) else None


@dataclass(frozen=True)
class Served:
    text: str
    meta_info: dict[str, Any]
    rest: Speculation | None


@dataclass(frozen=True)
class Speculation:
    """What the model is expected to write next: `output[pos:]` of one speculative call.

    `completion_tokens` is the size of the call's whole output and `ends` where each of its
    tokens ends (when known); `ended` says the model ended it (EOS) rather than the token
    budget; `role` is where it was made."""

    output: str
    pos: int
    params: GenParams
    completion_tokens: int
    ends: tuple[int, ...] | None
    ended: bool
    role: str | None

    @classmethod
    def from_call(cls, text: str, meta_info: dict[str, Any], params: GenParams,
                  role: str | None) -> Speculation | None:
        tokens = meta_info.get("completion_tokens")
        reason = meta_info.get("finish_reason") or {}
        if not isinstance(tokens, int):
            return None  # the budget of the served gens could not be checked
        ended = isinstance(reason, dict) and reason.get("type") == "stop"
        return cls(text, 0, _key(params), tokens, token_ends(text, meta_info), ended, role)

    @property
    def text(self) -> str:
        return self.output[self.pos:]

    def after_text(self, text: str) -> Speculation | None:
        """This speculation once the program appends literal `text`; None if it disagrees."""
        if self.output.startswith(text, self.pos):
            return replace(self, pos=self.pos + len(text))
        return None

    def _tokens(self, end: int) -> int:
        """Tokens a real call writes to produce `output[pos:end]` (those overlapping it)."""
        if self.ends is None:
            return self.completion_tokens  # unknown: the whole call bounds every piece
        first = bisect_right(self.ends, self.pos)
        last = bisect_left(self.ends, end)
        return min(last, len(self.ends) - 1) - first + 1 if end > self.pos else 0

    def runs_out(self, params: GenParams) -> bool:
        """The speculated text ends (by the call's budget) before any of the gen's stops."""
        return not self.ended and StopStrings.of(params.stop).first(self.text) is None

    def serve(self, params: GenParams) -> Served | None:
        """The gen's text cut from the speculation, or None when it cannot be proven equal to
        what a real call would give."""
        if not can_serve(params) or _key(params) != self.params or params.max_new_tokens is None:
            return None
        text = self.text
        hit = StopStrings.of(params.stop).first(text)  # where a real call's text would stop
        if hit is not None:
            pos, stop = hit
            end = self.pos + pos
            if self._tokens(end + len(stop)) > params.max_new_tokens:
                return None  # a real call would run out of tokens before its stop
            return Served(text[:pos], {"finish_reason": finish_stop(stop), "speculative": True},
                          replace(self, pos=end))
        tokens = self._tokens(len(self.output))
        if self.ended and tokens <= params.max_new_tokens:
            # The model stopped here by itself; a real call would too.
            return Served(text, {"finish_reason": {"type": "stop"}, "speculative": True}, None)
        at_token = self.pos == 0 or (self.ends is not None and self.pos in self.ends)
        if not self.ended and at_token and tokens == params.max_new_tokens:
            # The call's budget ended it exactly where the gen's own budget ends.
            return Served(text, {"finish_reason": {"type": "length"}, "speculative": True}, None)
        return None
