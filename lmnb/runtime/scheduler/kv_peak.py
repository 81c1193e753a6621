"""The most KV a set of requests of known length will hold at once.

A request that only the length limit can end (`stop.ends_by_length_only`: `ignore_eos`, no stop
ids, strings, regexes or grammar) holds `held` slots now and allocates one more a pass for its
`left` remaining tokens, then hands all of them back to the cache. Together the set holds, after
t more passes, the sum of `held + t` over the requests with `left >= t`: a sum that grows between
the passes where a request ends and drops at each, so its peak is at one of the `left` values.
Admission keeps that peak within the pool: such requests sharing no prefix are never retracted,
and the pool is not kept back for tokens of requests that will have ended by then (a reserve
summed over the requests keeps back every request's last token at once). A prefix shared with a
request that ends stays held, which the per-request sums do not see: retraction (decode.py)
stays the safety net, as it is for the reserve of requests that may stop early.
"""

from __future__ import annotations

import bisect


class KVPeak:
    """Requests as (held, left) pairs; `peak_with` the set's peak with one more, in O(log n).

    Kept in order of `left`, largest first: the set's usage when the k-th request (k from 1)
    makes its last allocation is `value[k] = cum_held[k] + left[k] * k`, and the peak is the
    largest value. One more request at place p adds its `held` and one more `left[k]` to the
    values after it."""

    def __init__(self, pairs: list[tuple[int, int]] | None = None) -> None:
        self._pairs: list[tuple[int, int]] = sorted(  # by `left`, largest first
            ((held, max(left, 0)) for held, left in pairs or ()), key=lambda pair: -pair[1])
        self._keys = [-left for _, left in self._pairs]  # ascending, for bisect
        self.held = sum(held for held, _ in self._pairs)  # slots the set holds now
        self._cum: list[int] = []  # [k]: held of the first k
        self._best_before: list[int] = []  # [k]: the largest value among the first k
        self._best_after: list[int] = []  # [k]: the largest value[j] + left[j] for j >= k
        self._rebuild()

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, held: int, left: int) -> None:
        self._insert(held, left)
        self._rebuild()

    def peak(self) -> int:
        return self._best_before[-1]

    def peak_with(self, held: int, left: int) -> int:
        """max over t >= 0 of sum(held_i + t for left_i >= t), the set plus (held, left)."""
        left = max(left, 0)
        place = bisect.bisect_right(self._keys, -left)  # after those with as many left
        own = self._cum[place] + held + left * (place + 1)
        return max(self._best_before[place], own, self._best_after[place] + held)

    def _insert(self, held: int, left: int) -> None:
        left = max(left, 0)
        place = bisect.bisect_right(self._keys, -left)
        self._keys.insert(place, -left)
        self._pairs.insert(place, (held, left))
        self.held += held

    def _rebuild(self) -> None:
        cum, before, values = [0], [0], []
        for k, (held, left) in enumerate(self._pairs, start=1):
            cum.append(cum[-1] + held)
            values.append(cum[-1] + left * k)
            before.append(max(before[-1], values[-1]))
        after = [0] * (len(values) + 1)
        for k in range(len(values) - 1, -1, -1):
            after[k] = max(after[k + 1], values[k] + self._pairs[k][1])
        self._cum, self._best_before, self._best_after = cum, before, after
