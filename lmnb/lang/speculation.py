"""API speculative execution (SGLang paper, section 5).

With `@function(num_api_spec_tokens=N)`, the first `gen` of a run of gens makes one call with its
stop strings removed and `max_tokens` raised to at least N: the model keeps writing past the stop.
Later literal text must match the speculated continuation, and later `gen`s are cut from it at
their own stop, without a call. Anything that does not match (text, sampling parameters, a stop
that is not found, a token budget that cannot be proven) drops the speculation and the gen makes a
real call: speculation saves calls, it never changes an answer. (It assumes, as SGLang does, that
the model's continuation depends on the text, not on how earlier output was split into tokens.)

A `Speculation` is immutable; each program state holds its own, and a fork copies the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lmnb.lang.ir import GenParams

# Parameters a speculative call and the gens served from it must agree on; the stop strings and
# token budget are the gen's own and are checked against the speculated text instead.
_PER_GEN = ("stop", "max_new_tokens")


def can_serve(params: GenParams) -> bool:
    """Whether a gen with these parameters can be cut from speculated text: plain sampling with
    stop strings that can be found in text (no constraints, token stops, n>1, logprobs)."""
    return (
        (params.n or 1) == 1
        and params.regex is None and params.json_schema is None
        and not params.stop_regex and not params.stop_token_ids
        and not params.return_logprob and not params.ignore_eos
        and not params.min_new_tokens
    )


def can_start(params: GenParams) -> bool:
    """Whether a gen may make a speculative call: servable and ended by a stop string."""
    return can_serve(params) and bool(params.stop)


def speculative_params(params: GenParams, num_tokens: int) -> GenParams:
    """The call that continues past the gen's stop: no stop strings, at least `num_tokens`."""
    return replace(params, stop=None, max_new_tokens=max(params.max_new_tokens or 0, num_tokens))


def _key(params: GenParams) -> GenParams:
    return replace(params, **{name: None for name in _PER_GEN})


@dataclass(frozen=True)
class Served:
    text: str
    meta_info: dict[str, Any]
    rest: Speculation | None


@dataclass(frozen=True)
class Speculation:
    """Text the model is expected to write from the current end of the program's text.

    `completion_tokens` is the size of the whole speculative call's output and `ended` whether
    the model ended it itself (EOS) rather than the token budget; `role` is where it was made."""

    text: str
    params: GenParams
    completion_tokens: int
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
        return cls(text, _key(params), tokens, ended, role)

    def after_text(self, text: str) -> Speculation | None:
        """This speculation once the program appends literal `text`; None if it disagrees."""
        if self.text.startswith(text):
            return replace(self, text=self.text[len(text):])
        return None

    def serve(self, params: GenParams) -> Served | None:
        """The gen's text cut from the speculation, or None when it cannot be proven equal to
        what a real call would give."""
        if not can_serve(params) or _key(params) != self.params:
            return None
        # Every piece of the speculated text took at most `completion_tokens` tokens to write.
        if params.max_new_tokens is None or self.completion_tokens > params.max_new_tokens:
            return None
        hits = [(self.text.find(stop), stop) for stop in params.stop or () if stop]
        hits = [(pos, stop) for pos, stop in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            reason: dict[str, Any] = {"type": "stop", "matched": stop}
            return Served(self.text[:pos], {"finish_reason": reason, "speculative": True},
                          replace(self, text=self.text[pos:]))
        if self.ended:  # the model stopped here by itself; a real call would too
            return Served(self.text, {"finish_reason": {"type": "stop"}, "speculative": True},
                          None)
        return None
