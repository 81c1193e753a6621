"""Small writers of regex text shared by the JSON-schema translation: grouping, alternation,
repetition and escaping."""

from __future__ import annotations

import re

_REGEX_SPECIALS = frozenset("\\.^$*+?{}[]|()")


def group(regex: str) -> str:
    return f"({regex})" if "|" in regex else regex


def alternatives(regexes: list[str | None]) -> str | None:
    kept = list(dict.fromkeys(r for r in regexes if r is not None))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else "(" + "|".join(kept) + ")"


def repeat(regex: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return ""
    quantifier = {(0, None): "*", (1, None): "+", (0, 1): "?", (1, 1): ""}.get((lo, hi))
    if quantifier is None:
        quantifier = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
    if not quantifier:
        return regex
    atom = regex if re.fullmatch(r"\[[^\]]*\]|\\?.", regex) else f"({regex})"
    return atom + quantifier


def literal_text(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


def class_char(c: str) -> str:
    code = ord(c)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return f"\\x{code:02x}"
    return "\\" + c if c in "\\]^-[&~|" else c
