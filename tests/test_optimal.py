"""The optimal hit rate (Theorem 3.1) against brute force over every request order."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmnb.runtime.radix.optimal import optimal_computed_tokens, optimal_hit_rate, trie_size


def prefixes(seqs: Sequence[Sequence[int]]) -> set[tuple[int, ...]]:
    return {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}


def brute_force_computed(prompts: list[list[int]], min_computed: int,
                         cached: Sequence[Sequence[int]] = ()) -> int:
    """Serves the requests one at a time in every order with an unbounded prefix cache."""
    best = None
    for order in itertools.permutations(prompts):
        cache = prefixes(cached)
        computed = 0
        for prompt in order:
            limit = len(prompt) - min_computed
            matched = max((k for k in range(limit + 1) if k == 0 or tuple(prompt[:k]) in cache),
                          default=0)
            computed += len(prompt) - matched
            cache |= prefixes([prompt])
        best = computed if best is None else min(best, computed)
    return best or 0


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=5), st.lists(tokens, max_size=2),
       st.sampled_from([0, 1]))
def test_matches_brute_force(prompts: list[list[int]], cached: list[list[int]],
                             min_computed: int) -> None:
    expected = brute_force_computed(prompts, min_computed, cached)
    assert optimal_computed_tokens(prompts, min_computed=min_computed, cached=cached) == expected
    total = sum(map(len, prompts))
    assert optimal_hit_rate(prompts, min_computed=min_computed, cached=cached) == \
        pytest.approx(1 - expected / total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=8))
def test_trie_size_counts_distinct_prefixes(seqs: list[list[int]]) -> None:
    assert trie_size(seqs) == len(prefixes(seqs))


def test_identical_prompts() -> None:
    prompt = list(range(10))
    assert trie_size([prompt] * 4) == 10
    assert optimal_computed_tokens([prompt] * 4, min_computed=0) == 10
    assert optimal_computed_tokens([prompt] * 4) == 10 + 3  # each repeat computes its last token
    assert optimal_hit_rate([prompt] * 4) == pytest.approx(1 - 13 / 40)
    assert optimal_hit_rate([prompt] * 4, min_computed=0) == pytest.approx(0.75)


def test_disjoint_prompts() -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert trie_size(prompts) == 9
    assert optimal_hit_rate(prompts) == 0.0
    assert optimal_hit_rate(prompts, min_computed=0) == 0.0


def test_one_prompt_a_prefix_of_another() -> None:
    short, long = [1, 2, 3], [1, 2, 3, 4, 5]
    assert trie_size([short, long]) == 5
    # The short one first: the long one matches all three tokens and computes two.
    assert optimal_computed_tokens([long, short]) == 5
    assert optimal_computed_tokens([long, short], min_computed=0) == 5
    assert optimal_computed_tokens([long, long, short]) == 6
    assert optimal_hit_rate([short, long]) == pytest.approx(3 / 8)


def test_cached_sequences_cost_nothing() -> None:
    turn1 = [1, 2, 3, 4]  # a previous turn: prompt plus output, all in the cache
    turn2 = [1, 2, 3, 4, 5, 6]
    assert optimal_computed_tokens([turn2], cached=[turn1]) == 2
    assert optimal_computed_tokens([turn1], cached=[turn1]) == 1  # still its last token
    assert optimal_computed_tokens([turn1], cached=[turn1], min_computed=0) == 0
    assert optimal_computed_tokens([[1, 2]], cached=[turn1]) == 1


def test_empty_inputs() -> None:
    assert trie_size([]) == 0
    assert optimal_hit_rate([]) == 0.0
    assert optimal_computed_tokens([[]]) == 0
    with pytest.raises(ValueError):
        optimal_hit_rate([[1]], min_computed=2)


def test_thousands_of_long_prompts_are_fast() -> None:
    rng = random.Random(0)
    shared = [rng.randrange(50000) for _ in range(500)]
    # Distinct first suffix tokens: the prompts share exactly the 500-token prefix.
    prompts = [shared + [50000 + i] + [rng.randrange(50000) for _ in range(499)]
               for i in range(2000)]
    prompts += prompts[:500]  # duplicates
    start = time.perf_counter()
    assert trie_size(prompts) == 500 + 2000 * 500
    computed = optimal_computed_tokens(prompts)
    assert time.perf_counter() - start < 60.0  # ~0.5 s here; a quadratic trie takes hours
    assert computed == 500 + 2000 * 500 + 500
