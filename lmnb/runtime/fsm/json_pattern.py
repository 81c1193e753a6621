"""A JSON-schema string `pattern` (a regex over the decoded string) translated into a regex over
the string's JSON text, where some characters must appear escaped."""

from __future__ import annotations

import re
import sys
from typing import Any

from lmnb.runtime.fsm.json_text import RAW_EXCLUDED, STRING_CHAR, InvalidSchemaError
from lmnb.runtime.fsm.regex_text import class_char, literal_text, repeat

if sys.version_info >= (3, 11):
    from re import _parser as _sre
else:  # pragma: no cover
    import sre_parse as _sre


_CATEGORIES = {
    _sre.CATEGORY_DIGIT: r"\d", _sre.CATEGORY_NOT_DIGIT: r"\D",
    _sre.CATEGORY_SPACE: r"\s", _sre.CATEGORY_NOT_SPACE: r"\S",
    _sre.CATEGORY_WORD: r"\w", _sre.CATEGORY_NOT_WORD: r"\W",
}
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_NEEDS_ESCAPE = ['"', "\\"] + [chr(i) for i in range(0x20)]
_BAD_INTERVALS = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_STARTS = (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING)
_ENDS = (_sre.AT_END, _sre.AT_END_STRING)


class PatternTranslator:
    """A `pattern` (a regex over the decoded string) -> a regex over the string's JSON text."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def fail(self, what: str) -> InvalidSchemaError:
        return InvalidSchemaError(f"'pattern' {self.pattern!r}: {what} is not supported")

    def regex(self) -> str:
        try:
            parsed = _sre.parse(self.pattern)
        except re.error as e:
            raise InvalidSchemaError(f"'pattern' {self.pattern!r} is not a valid regex: {e}"
                                     ) from None
        if parsed.state.flags & ~int(re.UNICODE):
            raise self.fail("an inline flag")
        return self.anchored(list(parsed), start=False, end=False)

    def anchored(self, items: list, *, start: bool, end: bool) -> str:
        while items and items[0][0] is _sre.AT and items[0][1] in _STARTS:
            start, items = True, items[1:]
        while items and items[-1][0] is _sre.AT and items[-1][1] in _ENDS:
            end, items = True, items[:-1]
        if len(items) == 1:
            op, arg = items[0]
            if op is _sre.BRANCH:
                return "(" + "|".join(self.anchored(list(alt), start=start, end=end)
                                      for alt in arg[1]) + ")"
            if op is _sre.SUBPATTERN and not arg[1] and not arg[2]:
                return self.anchored(list(arg[3]), start=start, end=end)
        body = self.sequence(items)
        if not body and not (start and end):
            return STRING_CHAR + "*"
        return ("" if start else STRING_CHAR + "*") + body + ("" if end else STRING_CHAR + "*")

    def sequence(self, items: Any) -> str:
        return "".join(self.item(op, arg) for op, arg in items)

    def item(self, op: Any, arg: Any) -> str:
        if op is _sre.LITERAL:
            return self.char(chr(arg))
        if op is _sre.NOT_LITERAL:
            return self.charset([(_sre.LITERAL, arg)], negate=True)
        if op is _sre.ANY:
            return self.charset([(_sre.LITERAL, ord("\n"))], negate=True)
        if op is _sre.IN:
            negate = bool(arg) and arg[0][0] is _sre.NEGATE
            return self.charset(arg[1:] if negate else arg, negate=negate)
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
            lo, hi, sub = arg
            return repeat(self.sequence(sub), lo, None if hi == _sre.MAXREPEAT else hi)
        if op is _sre.SUBPATTERN:
            if arg[1] or arg[2]:
                raise self.fail("an inline flag")
            return f"({self.sequence(arg[3])})"
        if op is _sre.BRANCH:
            return "(" + "|".join(self.sequence(alt) for alt in arg[1]) + ")"
        names = {_sre.AT: "an anchor inside the pattern or '\\b'", _sre.ASSERT: "a lookaround",
                 _sre.ASSERT_NOT: "a lookaround", _sre.GROUPREF: "a backreference",
                 _sre.GROUPREF_EXISTS: "a conditional group"}
        raise self.fail(names.get(op, f"{str(op).lower()!r}"))

    def char(self, c: str) -> str:
        if c in _NEEDS_ESCAPE:
            return _escapes([c])
        return literal_text(c)

    def charset(self, items: list, *, negate: bool) -> str:
        def member(c: str) -> bool:
            return any(_set_item_contains(op, arg, c) for op, arg in items) != negate

        raw: list[str] = []
        if negate:
            listed = "".join(_set_item_text(op, arg) for op, arg in items)
            raw.append("[^" + listed + RAW_EXCLUDED + "]")
        else:
            intervals = []
            for op, arg in items:
                if op is _sre.LITERAL:
                    intervals.append((arg, arg))
                elif op is _sre.RANGE:
                    intervals.append(arg)
                elif op is _sre.CATEGORY:
                    raw.append("[^" + _CATEGORIES[arg].swapcase() + RAW_EXCLUDED + "]")
                else:
                    raise self.fail(f"{str(op).lower()!r} in a character class")
            allowed = _subtract(intervals, _BAD_INTERVALS)
            if allowed:
                raw.insert(0, "[" + "".join(class_char(chr(a)) if a == b else
                                            f"{class_char(chr(a))}-{class_char(chr(b))}"
                                            for a, b in allowed) + "]")
        escaped = [c for c in _NEEDS_ESCAPE if member(c)]
        options = raw + ([_escapes(escaped)] if escaped else [])
        if not options:
            raise self.fail("a character class that matches no string character")
        return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"


def _set_item_contains(op: Any, arg: Any, c: str) -> bool:
    if op is _sre.LITERAL:
        return ord(c) == arg
    if op is _sre.RANGE:
        return arg[0] <= ord(c) <= arg[1]
    return op is _sre.CATEGORY and re.fullmatch(_CATEGORIES[arg], c) is not None


def _set_item_text(op: Any, arg: Any) -> str:
    if op is _sre.LITERAL:
        return class_char(chr(arg))
    if op is _sre.RANGE:
        return f"{class_char(chr(arg[0]))}-{class_char(chr(arg[1]))}"
    return _CATEGORIES[arg]


def _subtract(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """Code-point intervals minus sorted, disjoint `holes`."""
    result = []
    for lo, hi in sorted(intervals):
        for hole_lo, hole_hi in holes:
            if hole_hi < lo or hole_lo > hi:
                continue
            if hole_lo > lo:
                result.append((lo, hole_lo - 1))
            lo = hole_hi + 1
        if lo <= hi:
            result.append((lo, hi))
    return result


def _escapes(chars: list[str]) -> str:
    """JSON escape sequences of `chars` (each must need escaping): short form where there is
    one, else `\\u00XX` in either case."""
    options = []
    short = [_SHORT_ESCAPES[c] for c in chars if c in _SHORT_ESCAPES]
    if short:
        options.append("\\\\" + ("[" + "".join(class_char(s) for s in short) + "]"
                                 if len(short) > 1 else literal_text(short[0])))
    coded = [ord(c) for c in chars if c not in _SHORT_ESCAPES]
    for high in (0, 1):
        lows = [code & 0xF for code in coded if code >> 4 == high]
        if lows:
            digits = "".join(f"{low:x}{low:X}" if low > 9 else str(low) for low in lows)
            options.append(f"\\\\u00{high}[{digits}]")
    return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"
