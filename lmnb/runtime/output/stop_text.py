"""`StopText`: the scheduler's early view of the text of a request with stop strings or stop
regexes. It decodes the output on the scheduler thread, the same way the output processor does,
and applies `stop.py`'s rules to it, so both stop the text at the same place."""

from __future__ import annotations

from lmnb.params import SamplingParams
from lmnb.runtime.output.detokenizer import Decoder, IncrementalDetokenizer
from lmnb.runtime.output.stop import (
    STOP_REGEX_WINDOW,
    compile_stop_regex,
    first_stop_regex_match,
)


class StopText:
    """Decodes one request's output (as the output processor does) to watch its stop strings
    and stop regexes; `matched` is the stop string or regex match once one completes."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int],
                 params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop)
        self.patterns = compile_stop_regex(params.stop_regex)
        self.matched: str | None = None

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return bool(params.stop or params.stop_regex)

    def add(self, ids: list[int]) -> None:
        before = len(self.detokenizer.decoded_text)
        self.detokenizer.add(ids)
        if self.detokenizer.matched_stop is not None:
            self.matched = self.detokenizer.matched_stop
            return
        if self.patterns:
            text = self.detokenizer.decoded_text  # a match may end in text held for a stop
            match = first_stop_regex_match(self.patterns, text,
                                           max(before - STOP_REGEX_WINDOW, 0))
            if match is not None:
                self.matched = match.group()
