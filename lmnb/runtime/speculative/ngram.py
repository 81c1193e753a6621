"""N-gram draft proposals (SGLang's `speculative_algorithm="NGRAM"`): the tokens that followed the
latest earlier occurrence of the context's longest matching suffix, in the request's own prompt and
output first, then in recent requests' token sequences.

A `TokenSequence` indexes where each token and each pair of tokens occurs; a proposal scans the
most recent occurrences of the context's last pair (or last token), measures how far each matches
the context backwards (at most `max_depth` tokens, SGLang's `speculative_ngram_max_trie_depth`) and
continues the best one: the longest match, ties broken by recency ("BFS") or by how often the
continuation's first token follows the match ("PROB").
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

MAX_CANDIDATES = 32  # most recent occurrences of the context's last pair scanned per sequence
MAX_CORPUS_SEQUENCES = 16  # recent requests searched per proposal


@dataclass(frozen=True, slots=True)
class Match:
    """A continuation found for a context: `depth` context tokens matched, `tokens` followed."""

    depth: int
    tokens: list[int]


class TokenSequence:
    """One token sequence (growing at its end) with the positions of each token and token pair."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._by_token: dict[int, list[int]] = {}
        self._by_pair: dict[tuple[int, int], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, by_token, by_pair = self.tokens, self._by_token, self._by_pair
        for token in tokens:
            j = len(seq)
            if j:
                by_pair.setdefault((seq[-1], token), []).append(j)
            by_token.setdefault(token, []).append(j)
            seq.append(token)

    def find(self, context: Sequence[int], *, k: int, max_depth: int, min_depth: int,
             prefer_frequent: bool, periodic: bool = False) -> Match | None:
        """The best continuation (at most `k` tokens) of `context` among the occurrences of its
        last token that some token follows, matching at least `min_depth` tokens. `periodic`:
        `context` is this sequence itself (its own end has no continuation), and a continuation
        that reaches the end goes on repeating the matched period (a loop continues)."""
        if not context or k <= 0:
            return None
        seq = self.tokens
        positions = None
        if len(context) >= 2:
            positions = self._by_pair.get((context[-2], context[-1]))
        if not positions and min_depth <= 1:
            positions = self._by_token.get(context[-1])
        if not positions:
            return None
        limit = len(seq) - 1
        best_depth, best = 0, []
        scanned = 0
        for index in range(len(positions) - 1, -1, -1):
            j = positions[index]
            if j >= limit:
                continue
            scanned += 1
            if scanned > MAX_CANDIDATES:
                break
            depth = _match_depth(seq, j, context, max_depth)
            if depth > best_depth:
                best_depth, best = depth, [j]
            elif depth == best_depth:
                best.append(j)
        if best_depth < max(min_depth, 1) or not best:
            return None
        j = best[0]  # the most recent of the longest matches
        if prefer_frequent and len(best) > 1:
            counts = Counter(seq[p + 1] for p in best)
            top = max(counts.values())
            j = next(p for p in best if counts[seq[p + 1]] == top)
        tokens = seq[j + 1:j + 1 + k]
        if periodic:  # the match repeats with period len(seq) - 1 - j: so does what follows
            period = len(seq) - 1 - j
            while len(tokens) < k:
                tokens.append(tokens[len(tokens) - period])
        return Match(best_depth, tokens)


def _match_depth(seq: list[int], j: int, context: Sequence[int], max_depth: int) -> int:
    """How many tokens of `context`'s end equal `seq` ending at position `j` (at most
    `max_depth`)."""
    depth, n = 0, min(max_depth, j + 1, len(context))
    while depth < n and seq[j - depth] == context[-1 - depth]:
        depth += 1
    return depth


class NgramCorpus:
    """Token sequences of recently finished requests (prompt + output), newest first, holding
    at most `capacity` tokens (SGLang's `speculative_ngram_capacity`). A sequence is kept as a
    plain list and indexed at its first search: a runtime that does not speculate (large
    batches, paused requests) pays no per-token work for the requests that finish, and only the
    `MAX_CORPUS_SEQUENCES` newest (the ones searched) hold an index."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sequences: deque[list[int] | TokenSequence] = deque()
        self._tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens[-self.capacity:])
        if len(tokens) < 2:
            return
        sequences = self._sequences
        sequences.appendleft(tokens)
        self._tokens += len(tokens)
        if len(sequences) > MAX_CORPUS_SEQUENCES:  # no longer searched: its index goes
            older = sequences[MAX_CORPUS_SEQUENCES]
            if isinstance(older, TokenSequence):
                sequences[MAX_CORPUS_SEQUENCES] = older.tokens
        while self._tokens > self.capacity:
            self._tokens -= len(sequences.pop())

    def find(self, context: Sequence[int], *, k: int, max_depth: int, min_depth: int,
             prefer_frequent: bool) -> Match | None:
        best: Match | None = None
        sequences = self._sequences
        for i in range(min(len(sequences), MAX_CORPUS_SEQUENCES)):
            sequence = sequences[i]
            if not isinstance(sequence, TokenSequence):
                sequence = sequences[i] = TokenSequence(sequence)
            match = sequence.find(context, k=k, max_depth=max_depth, min_depth=min_depth,
                                  prefer_frequent=prefer_frequent)
            if match is not None and (best is None or match.depth > best.depth):
                best = match
        return best

    @property
    def indexed(self) -> int:
        """Sequences holding an index (the others are plain token lists)."""
        return sum(isinstance(sequence, TokenSequence)
                   for sequence in islice(self._sequences, MAX_CORPUS_SEQUENCES))

    def clear(self) -> None:
        self._sequences.clear()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens
