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

    Kept as groups of equal `left`, largest first (requests of one length, e.g. one batch's,
    share one group, so adding them is cheap): the set's usage when the last request of group
    g (from 1) makes its last allocation is `value[g] = cum_held[g] + left[g] * cum_count[g]`,
    and the peak is the largest value (a group's earlier requests reach less). One more request
    before group g adds its `held` and one more `left[g]` to the values from g on."""

    def __init__(self, pairs: list[tuple[int, int]] | None = None) -> None:
        self._keys: list[int] = []  # -left of each group, ascending (largest left first)
        self._helds: list[int] = []  # [g]: held summed over the group
        self._counts: list[int] = []  # [g]: requests in the group
        self.held = 0  # slots the set holds now
        for held, left in pairs or ():
            self._insert(held, left)
        self._cum: list[int] = []  # [g]: held of the first g groups
        self._cum_count: list[int] = []  # [g]: requests in the first g groups
        self._best_before: list[int] = []  # [g]: the largest value among the first g groups
        self._best_after: list[int] = []  # [g]: the largest value[j] + left[j] for j >= g
        self._rebuild()

    def __len__(self) -> int:
        return self._cum_count[-1]

    def add(self, held: int, left: int) -> None:
        self._insert(held, left)
        self._rebuild()

    def peak(self) -> int:
        return self._best_before[-1]

    def peak_with(self, held: int, left: int) -> int:
        """max over t >= 0 of sum(held_i + t for left_i >= t), the set plus (held, left)."""
        left = max(left, 0)
        place = bisect.bisect_right(self._keys, -left)  # after those with as many left
        own = self._cum[place] + held + left * (self._cum_count[place] + 1)
        return max(self._best_before[place], own, self._best_after[place] + held)

    def _insert(self, held: int, left: int) -> None:
        key = -max(left, 0)
        group = bisect.bisect_left(self._keys, key)
        if group < len(self._keys) and self._keys[group] == key:
            self._helds[group] += held
            self._counts[group] += 1
        else:
            self._keys.insert(group, key)
            self._helds.insert(group, held)
            self._counts.insert(group, 1)
        self.held += held

    def _rebuild(self) -> None:
        cum, cum_count, before, values = [0], [0], [0], []
        for key, held, count in zip(self._keys, self._helds, self._counts, strict=True):
            cum.append(cum[-1] + held)
            cum_count.append(cum_count[-1] + count)
            values.append(cum[-1] - key * cum_count[-1])
            before.append(max(before[-1], values[-1]))
        after = [0] * (len(values) + 1)
        for g in range(len(values) - 1, -1, -1):
            after[g] = max(after[g + 1], values[g] - self._keys[g])
        self._cum, self._cum_count = cum, cum_count
        self._best_before, self._best_after = before, after
