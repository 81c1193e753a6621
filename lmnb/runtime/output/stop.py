"""The stop-string decision, cheap enough for the scheduler thread.

The scheduler ends a request on the token whose text completes a stop string; the output thread's
`IncrementalDetokenizer` (given the same stops) cuts the text at that same occurrence. This helper
decodes only a short tail of ids: enough characters before the new tokens' text to hold the
longest stop string, and the detokenizer's own context (the prompt tail) when the tail reaches the
start of the output, so both see the same text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lmnb.runtime.output.detokenizer import Decoder

_REPLACEMENT = "\ufffd"


def stop_string_hit(tokenizer: Decoder, prompt_tail_ids: Sequence[int],
                    output_ids: Sequence[int], stops: Sequence[str], *, new_tokens: int = 1,
                    skip_special_tokens: bool = True, window: int | None = None) -> str | None:
    """The stop string completed by the last `new_tokens` output ids, or None.

    `prompt_tail_ids` is `prompt_tail(tokenizer, prompt_ids, ...)`, computed once per request.
    Call it after each appended token (or after a jump-forward with `new_tokens` = the ids that
    changed): a stop completed earlier would have ended the request then. Among stops completed
    by the new text, the one whose occurrence ends first wins, then the one starting first (the
    detokenizer's rule). `window` is the number of earlier ids decoded first (grown as needed).
    Cost: three decodes of a few ids (about 10-30 us on a fast HF tokenizer).
    """
    stops = [s for s in stops if s]
    if not stops or new_tokens <= 0 or not output_ids:
        return None
    longest = max(len(s) for s in stops)
    old_count = len(output_ids) - min(new_tokens, len(output_ids))
    # Most tokens carry several characters: start small, grow when the text is too short.
    count = max(window if window is not None else longest // 3 + 2, 1)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    while True:
        start = max(old_count - count, 0)
        # One id of context keeps the first id's leading space (SentencePiece); at the start of
        # the output the context is the detokenizer's prompt tail.
        head = list(prompt_tail_ids) if start == 0 else [output_ids[start - 1]]
        old = list(output_ids[start:old_count])
        begin = len(decode(head))
        old_text = decode(head + old)
        # The new ids' text starts where the old text's incomplete character (if any) started.
        new_at = max(len(old_text.rstrip(_REPLACEMENT)), begin)
        # A start inside a character decodes to U+FFFD: those are not characters of the text.
        garbage = len(old_text) - begin - len(old_text[begin:].lstrip(_REPLACEMENT))
        if start == 0 or new_at - begin - garbage >= longest - 1:
            break
        count *= 2
    full = decode(head + old + list(output_ids[old_count:]))
    end = len(full.rstrip(_REPLACEMENT))  # a trailing incomplete character is not text yet
    best: tuple[int, int] | None = None
    which = None
    for s in stops:
        i = full.find(s, max(begin, new_at - len(s) + 1), end)
        if i != -1 and (best is None or (i + len(s), i) < best):
            best, which = (i + len(s), i), s
    return which


def first_stop_regex_match(patterns: Sequence[re.Pattern], text: str,
                           start: int = 0) -> re.Match | None:
    """The earliest match of any `stop_regex` pattern in `text[start:]`: the scheduler ends the
    request on it and the output processor cuts the text at its start."""
    matches = [m for m in (p.search(text, start) for p in patterns) if m is not None]
    return min(matches, key=lambda m: m.start(), default=None)
