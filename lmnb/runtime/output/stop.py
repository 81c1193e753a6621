"""Where text-level stop rules cut the output: the scheduler ends a request on a stop_regex
match and the output processor cuts the text at the start of the same match."""

from __future__ import annotations

import re
from collections.abc import Sequence


def first_stop_regex_match(patterns: Sequence[re.Pattern], text: str,
                           start: int = 0) -> re.Match | None:
    """The earliest match of any `stop_regex` pattern in `text[start:]`: the scheduler ends the
    request on it and the output processor cuts the text at its start."""
    matches = [m for m in (p.search(text, start) for p in patterns) if m is not None]
    return min(matches, key=lambda m: m.start(), default=None)
