"""`KVPeak`: the most KV a set of length-known requests holds at once, against a pass-by-pass
simulation of the same requests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmnb.runtime.scheduler.kv_peak import KVPeak

pairs = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)), max_size=12)


def simulated_peak(requests: list[tuple[int, int]]) -> int:
    """Pass by pass: each request holds `held` slots, allocates one a pass while it has tokens
    left, and gives everything back once it has none (before the next pass)."""
    held = [h for h, _ in requests]
    left = [n for _, n in requests]
    peak = sum(held)
    while any(left):
        for i, n in enumerate(left):
            if n == 0:
                held[i] = 0  # done: handed back before the next pass
        for i, n in enumerate(left):
            if n:
                held[i] += 1
                left[i] -= 1
        peak = max(peak, sum(held))
    return peak


@given(pairs, st.integers(0, 50), st.integers(0, 40))
def test_peak_with_one_more_is_the_simulated_peak(requests, held, left) -> None:
    peak = KVPeak(requests)
    assert peak.peak_with(held, left) == simulated_peak([*requests, (held, left)])
    assert peak.peak() == simulated_peak(requests)
    assert peak.held == sum(h for h, _ in requests) and len(peak) == len(requests)


def test_staggered_ends_need_less_than_every_request_at_its_longest() -> None:
    peak = KVPeak([(10, 2), (10, 20)])
    assert peak.peak() == 10 + 20  # the short one has ended before the long one's peak
    assert peak.peak_with(10, 20) == 2 * (10 + 20)


# Few distinct lengths, as one batch's requests have: requests of one `left` share a group.
grouped_pairs = st.lists(st.tuples(st.integers(0, 50), st.sampled_from([-1, 0, 3, 3, 16, 40])),
                         max_size=16)


@given(grouped_pairs, grouped_pairs, st.integers(0, 50), st.integers(-1, 41))
def test_adding_one_at_a_time_matches_the_simulated_peak(first, added, held, left) -> None:
    peak = KVPeak(first)
    so_far = [(h, max(n, 0)) for h, n in first]
    for pair in added:
        assert peak.peak_with(*pair) == simulated_peak([*so_far, (pair[0], max(pair[1], 0))])
        peak.add(*pair)
        so_far.append((pair[0], max(pair[1], 0)))
        assert peak.peak() == simulated_peak(so_far)
    assert peak.peak_with(held, left) == simulated_peak([*so_far, (held, max(left, 0))])
    assert peak.held == sum(h for h, _ in so_far) and len(peak) == len(so_far)
