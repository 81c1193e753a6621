"""Regex -> trim, minimal-ish DFA over UTF-8 bytes: the automaton behind constrained decoding.

Python's own parser (`re._parser`) reads the pattern, so syntax, escapes, inline flags and Unicode
classes (`\\w`, `\\d`, `\\s`, `(?i)`, `(?a)`, `(?s)`) mean exactly what they mean to `re`: a
compiled ByteFSM fullmatches a string iff `re.fullmatch` does (strings with lone surrogates
aside: they have no UTF-8). Pipeline: parse tree -> Thompson NFA over code-point sets -> subset
construction over disjoint code-point intervals -> trim + Moore minimization -> each character
transition becomes UTF-8 byte transitions through hash-consed intermediate states (the utf8-ranges
idea: an intermediate state is a code-point block plus the targets inside it, shared by structure).

interegular, SGLang's parser, is not used: its `\\w`/`\\d`/`\\s` are ASCII-only, it lacks `\\u`
escapes and enumerates ranges character by character (a CJK class becomes 20k symbols).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from functools import cache, lru_cache
from typing import Any

import numpy as np

try:
    from re import _constants as _c
    from re import _parser as _p
except ImportError:  # Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

MAX_CP = 0x10FFFF
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000
CharSet = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive intervals
_Parts = tuple[tuple[int, int, int], ...]  # sorted disjoint (lo, hi, target) intervals
ALL: CharSet = ((0, MAX_CP),)
_SURROGATES = (0xD800, 0xDFFF)
_FLAG_MASK = re.IGNORECASE | re.ASCII  # the flags that change what a character class contains
_CATEGORY_ESCAPES = {
    _c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_SPACE: r"\s",
    _c.CATEGORY_NOT_SPACE: r"\S", _c.CATEGORY_WORD: r"\w", _c.CATEGORY_NOT_WORD: r"\W",
}
_ANCHORS_START = {_c.AT_BEGINNING, _c.AT_BEGINNING_STRING}
_ANCHORS_END = {_c.AT_END, _c.AT_END_STRING}


class InvalidRegexError(ValueError):
    """A pattern that `re` rejects, that uses a feature a DFA cannot express, or matches nothing."""


class ByteFSM:
    """A deterministic automaton over UTF-8 bytes for one regex.

    States 0..num_char_states-1 sit on character boundaries (0 is initial); higher states are inside
    a multi-byte character. The DFA is trim: every state can reach an accepting state, so a byte
    with a transition never leads into a dead end. Missing transitions (-1) are the dead state.
    `table` is the same map as a [num_states + 1, 256] int32 array whose last row is the dead
    state (absorbing), for vectorized walks.
    """

    __slots__ = ("pattern", "initial", "transitions", "accepting", "num_char_states", "table")

    def __init__(self, *, pattern: str, transitions: Sequence[dict[int, int]],
                 accepting: frozenset[int], num_char_states: int) -> None:
        self.pattern = pattern
        self.initial = 0
        self.transitions: tuple[dict[int, int], ...] = tuple(transitions)
        self.accepting = accepting
        self.num_char_states = num_char_states
        dead = len(self.transitions)
        table = np.full((dead + 1, 256), dead, dtype=np.int32)
        for state, row in enumerate(self.transitions):
            if row:
                table[state, list(row)] = list(row.values())
        self.table = table

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    @property
    def dead(self) -> int:
        """The dead state's row in `table`."""
        return len(self.transitions)

    def next(self, state: int, byte: int) -> int:
        return self.transitions[state].get(byte, -1) if state >= 0 else -1

    def walk(self, state: int, data: bytes) -> int:
        transitions = self.transitions
        for byte in data:
            if state < 0:
                return -1
            state = transitions[state].get(byte, -1)
        return state

    def fullmatch(self, text: str | bytes) -> bool:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        return self.walk(self.initial, data) in self.accepting

    def is_accepting(self, state: int) -> bool:
        return state in self.accepting

    def is_boundary(self, state: int) -> bool:
        """Whether `state` sits between whole characters (not inside a multi-byte one)."""
        return 0 <= state < self.num_char_states

    def __repr__(self) -> str:
        return (f"ByteFSM({self.pattern!r}, states={self.num_states}, "
                f"char_states={self.num_char_states}, accepting={len(self.accepting)})")


def compile_regex(pattern: str) -> ByteFSM:
    """Compiles `pattern` (Python `re` syntax, matched as `re.fullmatch`) into a ByteFSM.

    The last 256 patterns are cached. Raises InvalidRegexError."""
    if not isinstance(pattern, str):
        raise InvalidRegexError(f"a regex must be a str, got {type(pattern).__name__}")
    try:
        return _compile_cached(pattern)
    except RecursionError:
        raise InvalidRegexError(f"regex {pattern!r} is nested too deeply") from None


@lru_cache(maxsize=256)
def _compile_cached(pattern: str) -> ByteFSM:
    try:
        parsed = _p.parse(pattern, 0)
    except re.error as e:
        raise InvalidRegexError(f"invalid regex {pattern!r}: {e}") from None
    seq = _strip_anchors(list(parsed))
    if _nfa_size(seq) > MAX_NFA_STATES:
        raise InvalidRegexError(_too_large(pattern))
    nfa = _NFA(pattern)
    start, end = nfa.build(seq, parsed.state.flags)
    trans, accept = _determinize(nfa, start, end, pattern)
    trans, accept = _trim(trans, accept)
    if not trans:
        raise InvalidRegexError(f"regex {pattern!r} matches no string")
    trans, accept = _minimize(trans, accept)
    return _to_bytes(trans, accept, pattern)


# ---------------------------------------------------------------- code-point sets


def _normalize(ranges: Iterable[tuple[int, int]]) -> CharSet:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(cs: CharSet) -> CharSet:
    out, nxt = [], 0
    for lo, hi in cs:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


@cache
def _universe() -> str:
    """Every code point, in order: classes that only `re` knows exactly are read off it."""
    return "".join(map(chr, range(MAX_CP + 1)))


@lru_cache(maxsize=4096)
def _scan(char_class: str, flags: int) -> CharSet:
    """The code points that `re` matches with the one-character regex `char_class` under flags."""
    found = re.finditer(f"(?:{char_class})+", _universe(), flags)
    return tuple((m.start(), m.end() - 1) for m in found)


def _esc(cp: int) -> str:
    return f"\\U{cp:08x}"


def _class_items(items: list[tuple[Any, Any]], flags: int) -> CharSet:
    negate = False
    if flags & re.IGNORECASE:  # case folding is `re`'s business: render the class and scan
        parts = []
        for op, av in items:
            if op is _c.NEGATE:
                negate = True
            elif op is _c.LITERAL:
                parts.append(_esc(av))
            elif op is _c.RANGE:
                parts.append(f"{_esc(av[0])}-{_esc(av[1])}")
            else:
                parts.append(_CATEGORY_ESCAPES[av])
        return _scan(f"[{'^' if negate else ''}{''.join(parts)}]", flags & _FLAG_MASK)
    ranges: list[tuple[int, int]] = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            ranges.append((av, av))
        elif op is _c.RANGE:
            ranges.append(av)
        else:
            ranges.extend(_scan(_CATEGORY_ESCAPES[av], flags & _FLAG_MASK))
    cs = _normalize(ranges)
    return _complement(cs) if negate else cs


# ---------------------------------------------------------------- NFA


def _strip_anchors(seq: list[Any]) -> list[Any]:
    """fullmatch makes ^/\\A at the very start and $/\\Z at the very end no-ops; drop them (also
    inside a group or alternation that spans the whole pattern)."""
    while seq and seq[0][0] is _c.AT and seq[0][1] in _ANCHORS_START:
        seq = seq[1:]
    while seq and seq[-1][0] is _c.AT and seq[-1][1] in _ANCHORS_END:
        seq = seq[:-1]
    if len(seq) == 1 and seq[0][0] is _c.BRANCH:
        branches = [_strip_anchors(list(b)) for b in seq[0][1][1]]
        return [(_c.BRANCH, (None, branches))]
    if len(seq) == 1 and seq[0][0] is _c.SUBPATTERN:
        group, add_flags, del_flags, inner = seq[0][1]
        inner = _strip_anchors(list(inner))
        return [(_c.SUBPATTERN, (group, add_flags, del_flags, inner))]
    return seq


def _too_large(pattern: str) -> str:
    return (f"regex {pattern!r} is too large (over {MAX_NFA_STATES} NFA states; "
            "{m,n} counts multiply the pattern they repeat)")


def _nfa_size(seq: Iterable[tuple[Any, Any]]) -> int:
    """An upper bound of the NFA states `_NFA.build` makes for `seq`, to fail before building."""
    total = 1
    for op, av in seq:
        if op is _c.BRANCH:
            total += 2 + sum(_nfa_size(b) for b in av[1])
        elif op is _c.SUBPATTERN:
            total += _nfa_size(av[3])
        elif op is _c.MAX_REPEAT or op is _c.MIN_REPEAT:
            lo, hi, sub = av
            total += 2 + (lo + 1 if hi is _c.MAXREPEAT else hi) * _nfa_size(sub)
        else:
            total += 2
        if total > MAX_NFA_STATES:
            break
    return total


class _NFA:
    """Thompson NFA whose edges carry code-point sets; `build` returns a (start, end) fragment."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[CharSet, int]]] = []
        self._ops: dict[Any, Callable[[Any, int], tuple[int, int]]] = {
            _c.LITERAL: self._literal, _c.NOT_LITERAL: self._not_literal, _c.ANY: self._any,
            _c.IN: self._in, _c.BRANCH: self._branch, _c.SUBPATTERN: self._subpattern,
            _c.MAX_REPEAT: self._repeat, _c.MIN_REPEAT: self._repeat,
        }
        unsupported = {
            "ASSERT": "lookahead/lookbehind assertions ((?=...), (?!...), (?<=...), (?<!...))",
            "ASSERT_NOT": "lookahead/lookbehind assertions ((?=...), (?!...), (?<=...), (?<!...))",
            "GROUPREF": "backreferences (\\1, (?P=name))",
            "GROUPREF_IGNORE": "backreferences (\\1, (?P=name))",
            "GROUPREF_EXISTS": "conditional groups ((?(1)yes|no))",
            "POSSESSIVE_REPEAT": "possessive quantifiers (*+, ++, ?+, {m,n}+)",
            "ATOMIC_GROUP": "atomic groups ((?>...))",
            "AT": "anchors and boundaries other than a leading ^/\\A and a trailing $/\\Z",
        }
        for name, what in unsupported.items():
            if (op := getattr(_c, name, None)) is not None:
                self._ops[op] = self._unsupported(what)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise InvalidRegexError(_too_large(self.pattern))
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, seq: Iterable[tuple[Any, Any]], flags: int) -> tuple[int, int]:
        start = end = self.state()
        for op, av in seq:
            handler = self._ops.get(op)
            if handler is None:
                raise InvalidRegexError(f"regex {self.pattern!r}: {op} is not supported")
            s, e = handler(av, flags)
            self.eps[end].append(s)
            end = e
        return start, end

    def _unsupported(self, what: str) -> Callable[[Any, int], tuple[int, int]]:
        def fail(av: Any, flags: int) -> tuple[int, int]:
            raise InvalidRegexError(
                f"regex {self.pattern!r} uses {what}, which constrained decoding does not support")
        return fail

    def _chars(self, cs: CharSet) -> tuple[int, int]:
        s, e = self.state(), self.state()
        if cs:
            self.edges[s].append((cs, e))
        return s, e

    def _literal(self, cp: int, flags: int) -> tuple[int, int]:
        if flags & re.IGNORECASE:
            return self._chars(_scan(f"[{_esc(cp)}]", flags & _FLAG_MASK))
        return self._chars(((cp, cp),))

    def _not_literal(self, cp: int, flags: int) -> tuple[int, int]:
        if flags & re.IGNORECASE:
            return self._chars(_scan(f"[^{_esc(cp)}]", flags & _FLAG_MASK))
        return self._chars(_complement(((cp, cp),)))

    def _any(self, av: None, flags: int) -> tuple[int, int]:
        return self._chars(ALL if flags & re.DOTALL else _complement(((10, 10),)))

    def _in(self, items: list[tuple[Any, Any]], flags: int) -> tuple[int, int]:
        return self._chars(_class_items(items, flags))

    def _branch(self, av: tuple[None, list[Any]], flags: int) -> tuple[int, int]:
        s, e = self.state(), self.state()
        for branch in av[1]:
            bs, be = self.build(branch, flags)
            self.eps[s].append(bs)
            self.eps[be].append(e)
        return s, e

    def _subpattern(self, av: tuple[Any, ...], flags: int) -> tuple[int, int]:
        _group, add_flags, del_flags, seq = av
        return self.build(seq, (flags | add_flags) & ~del_flags)

    def _repeat(self, av: tuple[int, int, Any], flags: int) -> tuple[int, int]:
        lo, hi, seq = av
        start = cur = self.state()
        for _ in range(lo):
            s, e = self.build(seq, flags)
            self.eps[cur].append(s)
            cur = e
        if hi is _c.MAXREPEAT:
            loop = self.state()
            s, e = self.build(seq, flags)
            self.eps[cur].append(loop)
            self.eps[loop].append(s)
            self.eps[e].append(loop)
            return start, loop
        end = self.state()
        for _ in range(hi - lo):
            self.eps[cur].append(end)
            s, e = self.build(seq, flags)
            self.eps[cur].append(s)
            cur = e
        self.eps[cur].append(end)
        return start, end


# ---------------------------------------------------------------- character-level DFA

_Trans = list[list[tuple[int, int, int]]]  # per state: sorted disjoint (lo, hi, target)


def _determinize(nfa: _NFA, start: int, final: int, pattern: str) -> tuple[_Trans, list[bool]]:
    """Subset construction; a DFA state is the set of NFA states with character edges reached
    through epsilon moves (plus whether `final` was reached)."""
    eps, edges = nfa.eps, nfa.edges
    closures: dict[frozenset[int], int] = {}
    keys: dict[tuple[frozenset[int], bool], int] = {}
    members: list[frozenset[int]] = []
    accept: list[bool] = []

    def dfa_state(seeds: frozenset[int]) -> int:
        if (known := closures.get(seeds)) is not None:
            return known
        seen, stack = set(seeds), list(seeds)
        while stack:
            for nxt in eps[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        key = (frozenset(s for s in seen if edges[s]), final in seen)
        if (ident := keys.get(key)) is None:
            if len(members) >= MAX_DFA_STATES:
                raise InvalidRegexError(
                    f"regex {pattern!r} is too large (over {MAX_DFA_STATES} DFA states)")
            ident = keys[key] = len(members)
            members.append(key[0])
            accept.append(key[1])
        closures[seeds] = ident
        return ident

    dfa_state(frozenset((start,)))
    trans: _Trans = []
    while len(trans) < len(members):
        out = [(cs, t) for s in members[len(trans)] for cs, t in edges[s]]
        points = sorted({lo for cs, _ in out for lo, _ in cs} | {hi + 1 for cs, _ in out
                                                                   for _, hi in cs})
        targets: list[set[int]] = [set() for _ in points]
        for cs, t in out:
            for lo, hi in cs:
                for k in range(bisect_left(points, lo), bisect_left(points, hi + 1)):
                    targets[k].add(t)
        row: list[tuple[int, int, int]] = []
        for k, tset in enumerate(targets):
            if not tset:
                continue
            lo, hi, t = points[k], points[k + 1] - 1, dfa_state(frozenset(tset))
            if row and row[-1][2] == t and row[-1][1] + 1 == lo:
                row[-1] = (row[-1][0], hi, t)
            else:
                row.append((lo, hi, t))
        trans.append(row)
    return trans, accept


def _trim(trans: _Trans, accept: list[bool]) -> tuple[_Trans, list[bool]]:
    """Keeps the states reachable from 0 that can reach acceptance; renumbers (0 stays initial)."""
    back: list[list[int]] = [[] for _ in trans]
    for s, row in enumerate(trans):
        for _, _, t in row:
            back[t].append(s)
    live = {s for s, a in enumerate(accept) if a}
    stack = list(live)
    while stack:
        for p in back[stack.pop()]:
            if p not in live:
                live.add(p)
                stack.append(p)
    if 0 not in live:
        return [], []
    order, seen = [0], {0}
    for s in order:
        for _, _, t in trans[s]:
            if t in live and t not in seen:
                seen.add(t)
                order.append(t)
    new = {s: i for i, s in enumerate(order)}
    return ([_merge([(lo, hi, new[t]) for lo, hi, t in trans[s] if t in live]) for s in order],
            [accept[s] for s in order])


def _merge(row: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for lo, hi, t in row:
        if out and out[-1][2] == t and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, t)
        else:
            out.append((lo, hi, t))
    return out


def _minimize(trans: _Trans, accept: list[bool]) -> tuple[_Trans, list[bool]]:
    """The coarsest partition of the states that keeps acceptance and, per code point, the
    block of the target (a missing transition is its own block), by Hopcroft's refinement over
    the classes of code points no range boundary splits: O(classes * n log n) where Moore's
    rounds take O(n^2) on a long chain (a 5,000-character literal: 25 s). The block of state 0
    becomes state 0, the others numbered by their first state."""
    n = len(trans)
    cuts = sorted({lo for row in trans for lo, _, _ in row}
                  | {hi + 1 for row in trans for _, hi, _ in row})
    classes = len(cuts)  # class c: cuts[c] .. cuts[c + 1] - 1 (the last: past every range)
    missing = n  # the target of a missing transition, alone in its block
    # inverse[c][t]: the states whose class-c code points go to t
    inverse: list[dict[int, list[int]]] = [{} for _ in range(classes)]
    for s, row in enumerate(trans):
        targets = [missing] * classes
        for lo, hi, t in row:
            for c in range(bisect_right(cuts, lo) - 1, bisect_right(cuts, hi)):
                targets[c] = t
        for c, t in enumerate(targets):
            inverse[c].setdefault(t, []).append(s)
    for c in range(classes):
        inverse[c].setdefault(missing, []).append(missing)
    block_of = [int(a) for a in accept] + [2]
    blocks: dict[int, set[int]] = {}
    for s, b in enumerate(block_of):
        blocks.setdefault(b, set()).add(s)
    waiting = {(b, c) for b in blocks for c in range(classes)}
    next_id = 3
    while waiting:
        splitter, c = waiting.pop()
        into = inverse[c]
        touched: dict[int, list[int]] = {}
        for t in blocks[splitter]:
            for s in into.get(t, ()):
                touched.setdefault(block_of[s], []).append(s)
        for y, members in touched.items():
            if len(members) == len(blocks[y]):
                continue
            part = set(members)
            blocks[y] -= part
            blocks[next_id] = part
            for s in part:
                block_of[s] = next_id
            for c2 in range(classes):
                if (y, c2) in waiting:
                    waiting.add((next_id, c2))
                else:
                    waiting.add((next_id, c2) if len(part) <= len(blocks[y]) else (y, c2))
            next_id += 1
    order: dict[int, int] = {}
    for s in [0, *range(n)]:
        order.setdefault(block_of[s], len(order))
    out_trans: _Trans = [[] for _ in order]
    out_accept = [False] * len(order)
    for s, row in enumerate(trans):
        b = order[block_of[s]]
        out_trans[b] = _merge([(lo, hi, order[block_of[t]]) for lo, hi, t in row])
        out_accept[b] = accept[s]
    return out_trans, out_accept


# ---------------------------------------------------------------- UTF-8 bytes

# Multi-byte sequences: (first lead, last lead, continuation bytes, valid code points)
_LEADS = ((0xC2, 0xDF, 1, 0x80, 0x7FF), (0xE0, 0xEF, 2, 0x800, 0xFFFF),
          (0xF0, 0xF4, 3, 0x10000, MAX_CP))
_LEAD_MASK = {1: 0x1F, 2: 0x0F, 3: 0x07}  # payload bits of a lead byte


def _clip(parts: Sequence[tuple[int, int, int]], lo: int, hi: int) -> _Parts:
    """The part of sorted disjoint `parts` inside [lo, hi], rebased to lo."""
    out = []
    for a, b, t in parts[max(bisect_right(parts, (lo, MAX_CP, MAX_CP)) - 1, 0):]:
        if a > hi:
            break
        if b >= lo:
            out.append((max(a, lo) - lo, min(b, hi) - lo, t))
    return tuple(out)


def _without_surrogates(row: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out = []
    for a, b, t in row:
        if a <= _SURROGATES[1] and b >= _SURROGATES[0]:
            if a < _SURROGATES[0]:
                out.append((a, _SURROGATES[0] - 1, t))
            if b > _SURROGATES[1]:
                out.append((_SURROGATES[1] + 1, b, t))
        else:
            out.append((a, b, t))
    return out


def _to_bytes(trans: _Trans, accept: list[bool], pattern: str) -> ByteFSM:
    """Character transitions -> byte transitions. An intermediate state stands for `k` pending
    continuation bytes and the (rebased) targets inside the code-point block they select; equal
    ones are shared, so e.g. "any 2 continuation bytes, then state t" exists once per t.
    """
    num_char = len(trans)
    rows: list[dict[int, int]] = [{} for _ in trans]
    nodes: dict[tuple[int, _Parts], int] = {}

    def node(k: int, parts: _Parts) -> int:
        key = (k, parts)
        if (known := nodes.get(key)) is not None:
            return known
        row: dict[int, int] = {}
        shift = 6 * (k - 1)
        for a, b, t in parts:
            for j in range(a >> shift, (b >> shift) + 1):
                lo, hi = j << shift, ((j + 1) << shift) - 1
                if k == 1:
                    row[0x80 + j] = t
                elif a <= lo and hi <= b:
                    row[0x80 + j] = node(k - 1, ((0, hi - lo, t),))
                else:  # a partly covered child: gather every part inside it
                    row[0x80 + j] = node(k - 1, _clip(parts, lo, hi))
        ident = nodes[key] = len(rows)
        rows.append(row)
        return ident

    for s, row in enumerate(trans):
        out = rows[s]
        for lo, hi, t in row:
            for cp in range(lo, min(hi, 0x7F) + 1):
                out[cp] = t
        if not row or row[-1][1] < 0x80:
            continue
        row = _without_surrogates(row)
        for first, last, k, valid_lo, valid_hi in _LEADS:
            size = 1 << (6 * k)
            for lead in range(first, last + 1):
                base = (lead & _LEAD_MASK[k]) * size
                parts = _clip(row, max(base, valid_lo), min(base + size - 1, valid_hi))
                if parts:
                    offset = max(base, valid_lo) - base  # rebase to the block start
                    out[lead] = node(k, tuple((a + offset, b + offset, t) for a, b, t in parts))
    accepting = frozenset(s for s in range(num_char) if accept[s])
    return ByteFSM(pattern=pattern, transitions=rows, accepting=accepting, num_char_states=num_char)
