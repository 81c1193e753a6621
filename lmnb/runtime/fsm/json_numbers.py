"""Regexes for numeric ranges: integers and decimals between JSON-schema bounds, exactly, and
decimals whose double (parsed rounding to nearest) is within the bounds too."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from lmnb.runtime.fsm.regex_text import alternatives, group, repeat

# Past an exclusive 0, at most this many zeros before a fraction's first other digit: 1e-323
# parses to the double 9.9e-324; 1e-324, under half the least double (4.9e-324), to 0.0.
ZEROS_BEFORE_UNDERFLOW = 322


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _same_length_range(lo: str, hi: str) -> str:
    """Digit strings of one length between `lo` and `hi` inclusive."""
    if lo == hi:
        return lo
    n = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + group(_same_length_range(lo[1:], hi[1:]))
    parts, first, last = [], int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        parts.append(lo[0] + group(_same_length_range(lo[1:], "9" * n)))
        first += 1
    tail = None
    if hi[1:] != "9" * n:
        tail = hi[0] + group(_same_length_range("0" * n, hi[1:]))
        last -= 1
    if first <= last:
        parts.append(_digit_class(first, last) + repeat("[0-9]", n, n))
    if tail is not None:
        parts.append(tail)
    return "|".join(parts)


def _natural_range(lo: int, hi: int | None) -> str | None:
    """Decimal naturals (no leading zeros) in [lo, hi]; hi None is unbounded."""
    if hi is not None and hi < lo:
        return None
    low, high = str(lo), None if hi is None else str(hi)
    if high is not None and len(high) == len(low):
        return group(_same_length_range(low, high))
    parts = [_same_length_range(low, "9" * len(low))]
    longer = len(low) + 1
    if high is None:
        parts.append(f"[1-9][0-9]{{{longer - 1},}}")
    else:
        if len(high) > longer:
            parts.append("[1-9]" + repeat("[0-9]", longer - 1, len(high) - 2))
        parts.append(_same_length_range("1" + "0" * (len(high) - 1), high))
    return "(" + "|".join(parts) + ")"


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """Integers in [lo, hi] (None: unbounded), without "-0"."""
    positive = None
    if hi is None or hi >= 0:
        positive = _natural_range(max(lo, 0) if lo is not None else 0, hi)
    negative = None
    if lo is None or lo < 0:
        magnitude = _natural_range(max(-hi, 1) if hi is not None else 1,
                                   None if lo is None else -lo)
        negative = None if magnitude is None else "-" + magnitude
    return alternatives([positive, negative])


def _split(value: Decimal) -> tuple[int, str]:
    """Non-negative decimal -> (integer part, fraction digits without trailing zeros)."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _fraction(lo: str | None, lo_excl: bool, hi: str | None, hi_excl: bool, depth: int = 0
              ) -> tuple[str | None, bool]:
    """Digit strings R (read as 0.R) within the bounds: (regex of the non-empty ones, whether the
    empty one is allowed). Bounds are digit strings without trailing zeros; None is unbounded.
    `depth` fraction digits come before R. Above an exclusive all-zero lower bound (an
    exclusive 0: `float_range` makes other exclusive bounds inclusive) R starts with at most
    `ZEROS_BEFORE_UNDERFLOW` - depth zeros, so that the number does not parse to 0.0."""
    empty = (lo is None or (lo == "" and not lo_excl)) and (hi != "" or not hi_excl)
    if hi is None and lo == "" and lo_excl:
        zeros = ZEROS_BEFORE_UNDERFLOW - depth
        return (repeat("0", 0, zeros) + "[1-9][0-9]*" if zeros >= 0 else None), False
    if lo is None or (lo == "" and not lo_excl):
        if hi is None:
            return "[0-9]+", empty
        lo, lo_excl = "", False
        if hi == "":
            return (None if hi_excl else "0+"), empty
    if hi is not None and hi == "":
        return None, empty
    first_lo, rest_lo = (lo[0], lo[1:]) if lo else ("0", "")
    first_hi = None if hi is None else hi[0]
    parts: list[str | None] = []

    def follow(digit: str, *bounds: Any) -> str | None:
        regex, may_end = _fraction(*bounds, depth=depth + 1)
        if regex is None:
            return digit if may_end else None
        return digit + (f"({regex})?" if may_end else group(regex))

    if first_hi is None or first_lo < first_hi:
        parts.append(follow(first_lo, rest_lo, lo_excl, None, False))
        top = 9 if first_hi is None else int(first_hi) - 1
        if int(first_lo) + 1 <= top:
            parts.append(_digit_class(int(first_lo) + 1, top) + "[0-9]*")
        if first_hi is not None:
            parts.append(follow(first_hi, "", False, hi[1:], hi_excl))
    elif first_lo == first_hi:
        parts.append(follow(first_lo, rest_lo, lo_excl, hi[1:], hi_excl))
    kept = [p for p in parts if p is not None]
    return ("|".join(kept) if kept else None), empty


def _magnitude_range(lo: Decimal, lo_excl: bool, hi: Decimal | None, hi_excl: bool
                     ) -> str | None:
    """Plain decimals m >= 0 (`I` or `I.F`) between the bounds, lo >= 0."""
    lo_int, lo_frac = _split(lo)
    hi_int, hi_frac = (None, None) if hi is None else _split(hi)

    def with_fraction(whole: int, *bounds: Any) -> str | None:
        regex, may_end = _fraction(*bounds)
        if regex is None:
            return str(whole) if may_end else None
        dotted = rf"\.({regex})"
        return str(whole) + (f"({dotted})?" if may_end else dotted)

    if hi_int is not None and hi_int < lo_int:
        return None
    if hi_int == lo_int:
        return with_fraction(lo_int, lo_frac, lo_excl, hi_frac, hi_excl)
    parts = [with_fraction(lo_int, lo_frac, lo_excl, None, False)]
    middle = _natural_range(lo_int + 1, None if hi_int is None else hi_int - 1)
    if middle is not None:
        parts.append(middle + r"(\.[0-9]+)?")
    if hi_int is not None:
        parts.append(with_fraction(hi_int, "", False, hi_frac, hi_excl))
    return alternatives(parts)


def decimal_range(lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool
                   ) -> str | None:
    """Plain decimals (no exponent) within the bounds, but for the digits past an exclusive 0
    that would parse to 0.0 (`_fraction`); "-0" / "-0.0" count as zero."""
    zero = Decimal(0)
    positive = None
    if hi is None or hi >= 0:
        low, low_excl = (lo, lo_excl) if lo is not None and lo >= 0 else (zero, False)
        positive = _magnitude_range(low, low_excl, hi, hi_excl)
    negative = None
    if lo is None or lo <= 0:
        low, low_excl = (-hi, hi_excl) if hi is not None and hi <= 0 else (zero, False)
        magnitude = _magnitude_range(low, low_excl, None if lo is None else -lo, lo_excl)
        negative = None if magnitude is None else "-" + group(magnitude)
    return alternatives([positive, negative])


def _parsed_inside(bound: Decimal | None, exclusive: bool, inward: float
                   ) -> tuple[Decimal | None, bool]:
    """An exclusive bound b other than 0 as the inclusive bound at the shortest decimal of the
    double next to b towards `inward`: a number up to it parses to that double at most (rounding
    to nearest is monotonic), never onto b's own. An inclusive bound holds after parsing as is."""
    if bound is None or not exclusive or bound == 0:
        return bound, exclusive
    return Decimal(repr(math.nextafter(float(bound), inward))), False


def float_range(lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool
                ) -> str | None:
    """`decimal_range` of the numbers whose double is within the bounds too: past an exclusive
    bound's neighbouring double, or underflowing past an exclusive 0, none is written (so
    0.99999999999999999999, which parses to 1.0, is not below an exclusive 1)."""
    return decimal_range(*_parsed_inside(lo, lo_excl, math.inf),
                         *_parsed_inside(hi, hi_excl, -math.inf))
