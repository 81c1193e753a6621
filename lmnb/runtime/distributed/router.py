"""`Router`: which data-parallel replica serves a request (pure policy: no I/O, no threads).

Cache-aware routing (the SGLang paper's appendix A.4): the router's `MetaTree` knows which
replica holds which prefixes. A request goes to the replica with the longest cached prefix of its
tokens, unless that replica's load (requests this router has in flight there: queued + running)
is too far above the least-loaded replica's, or the match is too short to matter; then it goes to
the least-loaded replica (ties: the one believed to hold the fewest tokens, which spreads distinct
prefixes). A routed prompt enters the meta tree at once, so the next request sharing it (a fork's
branches, the rest of a batch) follows it before it is even computed; a finished request adds its
output. Replicas report evictions (`CacheEventLog`) and the router applies them, so the tree stays
honest.

Branch locality needs no program key: a fork's branches share the parent's text, which the meta
tree places on the replica that computed it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmnb.runtime.distributed.meta_tree import MetaTree

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`policy`: 'cache_aware' (default), 'round_robin' or 'least_load' (baselines).

    A matched replica loses the request to the least-loaded one when its load exceeds the least
    load by more than `balance_abs_threshold` requests AND is more than `balance_rel_threshold`
    times it. A match shorter than `cache_threshold` of the prompt does not count (a shared BOS
    or system line should not pull everything to one replica).
    """

    policy: str = "cache_aware"
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.25
    cache_threshold: float = 0.3

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose one of: "
                             f"{', '.join(POLICIES)}")
        if isinstance(self.balance_abs_threshold, bool) or not isinstance(
                self.balance_abs_threshold, int) or self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be an int >= 0, "
                             f"got {self.balance_abs_threshold!r}")
        if not isinstance(self.balance_rel_threshold, int | float) or \
                self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, "
                             f"got {self.balance_rel_threshold!r}")
        if not isinstance(self.cache_threshold, int | float) or \
                not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold!r}")


class Router:
    """Routing state over `num_replicas` replicas: meta tree, loads, liveness, counters.
    Not thread-safe: its owner locks around calls."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None, *,
                 capacities: Sequence[int] | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.config = config or RouterConfig()
        self.num_replicas = num_replicas
        self.capacities = list(capacities) if capacities is not None else None
        self.tree = MetaTree()
        self.loads = [0] * num_replicas  # requests in flight through this router
        self.inflight_tokens = [0] * num_replicas  # their prompts' tokens (claimed in the tree)
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas
        self.cache_routed = 0  # requests sent where the meta tree had their prefix
        self.balanced = 0  # requests a load imbalance moved away from their prefix
        self._clock = itertools.count(1)
        self._now = 0
        self._round_robin = 0

    def stamp(self) -> int:
        """The router's clock now (a bound for removals that a report asked for now)."""
        return self._now

    def _tick(self) -> int:
        self._now = next(self._clock)
        return self._now

    # ---- routing -------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [i for i in range(self.num_replicas) if self.alive[i]]

    def route(self, tokens: Sequence[int], weight: int = 1) -> int:
        """Picks the replica for a request of `tokens` and counts it (`weight` requests: its
        samples) in flight there."""
        live = self.live()
        if not live:
            raise RuntimeError("every data-parallel replica has died")
        policy = self.config.policy
        if policy == "round_robin":
            choice = live[self._round_robin % len(live)]
            self._round_robin += 1
        elif policy == "least_load":
            choice = self._least_loaded(live)
        else:
            choice = self._cache_aware(tokens, live)
            self.tree.insert(tokens, choice, self._tick())
            self._trim(choice)
        self.loads[choice] += weight
        self.inflight_tokens[choice] += weight * len(tokens)
        self.routed[choice] += weight
        return choice

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda i: (self.loads[i], self.tree.replica_tokens(i), i))

    def _cache_aware(self, tokens: Sequence[int], live: list[int]) -> int:
        matches = self.tree.match(tokens)
        best = max((matches.get(i, 0) for i in live), default=0)
        if best == 0 or best < self.config.cache_threshold * len(tokens):
            return self._least_loaded(live)
        matched = min((i for i in live if matches.get(i, 0) == best),
                      key=lambda i: (self.loads[i], i))
        least = min(self.loads[i] for i in live)
        load = self.loads[matched]
        if (load - least > self.config.balance_abs_threshold
                and load > self.config.balance_rel_threshold * least):
            self.balanced += 1
            return self._least_loaded(live)
        self.cache_routed += 1
        return matched

    # ---- feedback ------------------------------------------------------------------------------
    def finished(self, replica: int, prompt_len: int,
                 tokens: Sequence[int] | None = None) -> None:
        """A request of `prompt_len` prompt tokens routed to `replica` ended; `tokens` (prompt +
        output) is what it left in the replica's cache (None: nothing, e.g. it failed)."""
        self.loads[replica] = max(self.loads[replica] - 1, 0)
        self.inflight_tokens[replica] = max(self.inflight_tokens[replica] - prompt_len, 0)
        if tokens and self.config.policy == "cache_aware" and self.alive[replica]:
            self.tree.insert(tokens, replica, self._tick())
            self._trim(replica)

    def apply_events(self, replica: int, report: dict[str, Any], upto: int) -> None:
        """A replica's `cache_events` report, asked for when the clock read `upto`.

        Coverage stamped after `upto` survives the report's evictions (it may be KV computed
        again since); what that leaves claimed beyond the replica's reported size
        (`cached_tokens`, plus the prompts in flight there) goes least recently stamped first,
        as the replica's own LRU did."""
        if not report.get("complete", True):
            self.tree.forget(replica, upto)
        for event in report.get("events", ()):
            if event["type"] == "reset":
                self.tree.forget(replica, upto)
            elif event["type"] == "evict":
                self.tree.evicted(event["tokens"], replica, upto)
        if "cached_tokens" in report:
            self.tree.trim(replica, report["cached_tokens"] + self.inflight_tokens[replica], upto)

    def forget(self, replica: int) -> None:
        """`replica`'s cache was emptied (a flush the router asked for)."""
        self.tree.forget(replica, self._now)

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False
        self.tree.forget(replica, math.inf)

    def _trim(self, replica: int) -> None:
        if self.capacities is not None:
            capacity = self.capacities[replica]
            if self.tree.replica_tokens(replica) > 2 * capacity:
                self.tree.trim(replica, capacity)

    # ---- inspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"policy": self.config.policy, "routed": list(self.routed),
                "in_flight": list(self.loads), "alive": list(self.alive),
                "cache_routed": self.cache_routed, "balanced": self.balanced,
                "meta_tree_nodes": self.tree.node_count(),
                "meta_tree_tokens": [self.tree.replica_tokens(i)
                                     for i in range(self.num_replicas)]}
