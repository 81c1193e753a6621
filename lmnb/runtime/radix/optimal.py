"""The optimal prefix-cache hit rate of a set of requests (SGLang paper, Theorem 3.1).

With a cache at least as large as the longest request, a depth-first order over the radix tree of
the requests computes every distinct prefix exactly once, which is optimal: the tokens computed are
the size of the requests' trie. Our engine adds one rule (`min_computed=1`): a request always
computes its last prompt token, so `k` requests ending at the same trie node compute that node `k`
times, and one request that ends inside another's path still pays for its own last token.

The trie size is counted without building a trie: in sorted order, each sequence adds the tokens
past its longest common prefix with its predecessor.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lmnb.runtime.prefix_cache import common_prefix_length


def _sorted_unique(seqs: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    return sorted({tuple(s) for s in seqs})


def _distinct_prefixes(ordered: list[tuple[int, ...]]) -> int:
    total = 0
    previous: tuple[int, ...] = ()
    for seq in ordered:
        total += len(seq) - common_prefix_length(previous, seq)
        previous = seq
    return total


def trie_size(prompts: Sequence[Sequence[int]]) -> int:
    """The number of distinct non-empty prefixes of `prompts` (trie nodes, root excluded)."""
    return _distinct_prefixes(_sorted_unique(prompts))


def _is_prefix_of_any(seq: tuple[int, ...], ordered: list[tuple[int, ...]]) -> bool:
    """Whether `seq` is a prefix of a member of sorted `ordered`: if so, of its successor."""
    at = bisect.bisect_left(ordered, seq)
    return at < len(ordered) and ordered[at][:len(seq)] == seq


def optimal_computed_tokens(prompts: Sequence[Sequence[int]], *, min_computed: int = 1,
                            cached: Sequence[Sequence[int]] = ()) -> int:
    """The fewest prompt tokens that serving `prompts` must compute (prefill).

    `min_computed=1` is the engine's rule (a request computes at least its last token); `0` is the
    paper's (a fully cached prompt computes nothing). `cached` are sequences whose KV exists before
    these requests run (e.g. earlier turns' prompt plus output): their prefixes cost nothing.
    """
    if min_computed not in (0, 1):
        raise ValueError(f"min_computed must be 0 or 1, got {min_computed}")
    prompts = [p for p in prompts if len(p)]
    known = _sorted_unique([c for c in cached if len(c)])
    union = sorted(set(known).union(tuple(p) for p in prompts))
    computed = _distinct_prefixes(union) - _distinct_prefixes(known)
    if min_computed == 0:
        return computed
    # Each request ending at a node computes it; a node reached only by longer prompts, or
    # already cached, needs no separate computation for the requests that end there.
    distinct = {tuple(p) for p in prompts}
    uncached_ends = sum(not _is_prefix_of_any(p, known) for p in distinct)
    return computed + len(prompts) - uncached_ends


def optimal_hit_rate(prompts: Sequence[Sequence[int]], *, min_computed: int = 1,
                     cached: Sequence[Sequence[int]] = ()) -> float:
    """`1 - computed / prompt tokens` for the best order (Theorem 3.1); 0.0 for no tokens."""
    total = sum(len(p) for p in prompts)
    if total == 0:
        return 0.0
    computed = optimal_computed_tokens(prompts, min_computed=min_computed, cached=cached)
    return 1.0 - computed / total
