"""Every rule that ends a request, in one place: EOS, stop token ids, stop strings, stop_regex,
a completed or dead grammar, the length limit.

Text rules need text: only requests with stop strings or a stop_regex decode on the scheduler
thread (`StopText`); everyone else's text is made off the critical path by the output processor,
which applies the same rules to the same text, so both agree.
"""

from __future__ import annotations

import re
from typing import Any

from lmnb.runtime.core import SamplingParams, finish_length, finish_stop
from lmnb.runtime.output.detokenizer import IncrementalDetokenizer
from lmnb.runtime.output.stop import first_stop_regex_match

STOP_REGEX_WINDOW = 256  # characters before the new text that a stop_regex match may start in


class StopText:
    """Decodes one request's output (the same way the output processor does) to watch its stop
    strings and stop regexes."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop)
        self.patterns = [re.compile(p) for p in (params.stop_regex)]
        self.matched: str | None = None

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return bool(params.stop or params.stop_regex)

    def add(self, ids: list[int]) -> None:
        before = len(self.detokenizer.text)
        self.detokenizer.add(ids)
        if self.detokenizer.matched_stop is not None:
            self.matched = self.detokenizer.matched_stop
            return
        if self.patterns:
            text = self.detokenizer.text
            match = first_stop_regex_match(self.patterns, text,
                                           max(before - STOP_REGEX_WINDOW, 0))
            if match is not None:
                self.matched = match.group()


class StopRules:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def by_token(self, token: int, params: SamplingParams, output_len: int
                 ) -> dict[str, Any] | None:
        """EOS or a stop id, once `min_new_tokens` are out (the sampler masks them before)."""
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
        if output_len >= params.max_new_tokens:
            return finish_length(output_len)
        return None

    @staticmethod
    def after_text(stop_text: StopText | None, grammar: Any, params: SamplingParams,
                   output_len: int) -> dict[str, Any] | None:
        """A stop string or regex (from the first token on), a completed constraint, or the
        length limit."""
        if stop_text is not None and stop_text.matched is not None:
            return finish_stop(stop_text.matched)
        if grammar is not None and (grammar.is_final or grammar.is_dead):
            return finish_stop(None)
        if output_len >= params.max_new_tokens:
            return finish_length(output_len)
        return None
