"""`MetaTree`: the router's radix tree of what each data-parallel replica has cached (the SGLang
paper's appendix A.4), over token ids.

    root ── [sys, prompt]{0:7, 1:3} ──┬── [q1]{0:7}        each node: the replicas holding the
                                      └── [q2, q3]{1:3}    whole path to its end, with a stamp

Per replica, coverage is prefix-closed (a replica on a node is on its parent), as in the
replica's own radix tree. Stamps come from the router's clock (`Router.stamp`): inserting a path
stamps every node along it, so a node's stamp is never older than its descendants'. Removals
(a replica's reported evictions, a flush, a death) take a stamp bound `upto`: coverage stamped
after it was inserted after the replica's report was asked for, so it may describe KV the replica
computed again since, and is kept. Not thread-safe: the router locks around it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence

from lmnb.runtime.prefix_cache import common_prefix_length


class _Node:
    __slots__ = ("key", "children", "parent", "replicas")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.replicas: dict[int, int] = {}  # replica -> stamp of its latest insert here

    def __lt__(self, other: _Node) -> bool:  # heap tie-break only
        return id(self) < id(other)


class MetaTree:
    """Which replica holds which token prefixes; `match` answers per replica how long."""

    def __init__(self) -> None:
        self.root = _Node([], None)
        self._tokens: dict[int, int] = {}  # replica -> tokens it is known to hold

    # ---- reading -----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> dict[int, int]:
        """Per replica with any match, the length of its longest cached prefix of `tokens`."""
        best: dict[int, int] = {}
        node, depth, key = self.root, 0, list(tokens)
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            matched = common_prefix_length(child.key, key[depth:depth + len(child.key)])
            depth += matched
            for replica in child.replicas:
                best[replica] = depth
            if matched < len(child.key):
                break
            node = child
        return best

    def replica_tokens(self, replica: int) -> int:
        """Tokens `replica` is believed to hold."""
        return self._tokens.get(replica, 0)

    def node_count(self) -> int:
        return sum(1 for _ in self._walk(self.root)) - 1

    # ---- inserting ---------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], replica: int, stamp: int) -> None:
        """`replica` holds (or is about to hold) the KV of `tokens`."""
        node, depth, key = self.root, 0, list(tokens)
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(key[depth:], node)
                node.children[key[depth]] = child
            else:
                matched = common_prefix_length(child.key, key[depth:depth + len(child.key)])
                if matched < len(child.key):
                    child = self._split(child, matched)
            if replica not in child.replicas:
                self._tokens[replica] = self._tokens.get(replica, 0) + len(child.key)
            child.replicas[replica] = stamp
            depth += len(child.key)
            node = child

    @staticmethod
    def _split(node: _Node, at: int) -> _Node:
        """Cuts `node`'s edge after `at` tokens; returns the upper half (same replicas)."""
        upper = _Node(node.key[:at], node.parent)
        upper.replicas = dict(node.replicas)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # ---- forgetting --------------------------------------------------------------------------
    def evicted(self, tokens: Sequence[int], replica: int, upto: int = math.inf) -> None:
        """`replica` evicted the leaf reached by `tokens` (its path through the leaf's first
        token): it holds nothing that begins with `tokens`, so its coverage of the subtree in
        that direction goes (entries stamped after `upto` stay)."""
        if not tokens:
            return
        node, depth, key = self.root, 0, list(tokens)
        start = len(key) - 1  # the evicted edge starts here
        while True:
            child = node.children.get(key[depth])
            if child is None:
                return
            matched = common_prefix_length(child.key, key[depth:depth + len(child.key)])
            if depth + matched <= start:  # the path leaves the tree before the evicted edge
                if matched < len(child.key):
                    return
                node, depth = child, depth + matched
                continue
            if depth < start:  # the evicted edge starts inside this meta edge: split there
                child = self._split(child, start - depth).children[key[start]]
            self._forget_subtree(child, replica, upto)
            return

    def forget(self, replica: int, upto: int = math.inf) -> None:
        """`replica` emptied its cache (or died): all its coverage stamped up to `upto` goes."""
        for child in list(self.root.children.values()):
            self._forget_subtree(child, replica, upto)

    def _forget_subtree(self, top: _Node, replica: int, upto: int) -> None:
        for node in list(self._walk(top)):
            stamp = node.replicas.get(replica)
            if stamp is not None and stamp <= upto:
                del node.replicas[replica]
                self._tokens[replica] -= len(node.key)
        self._prune_empty(top)

    def _prune_empty(self, top: _Node) -> None:
        """Removes nodes no replica holds (bottom-up: an empty node's children are empty)."""
        for node in reversed(list(self._walk(top))):
            if not node.replicas and not node.children and node.parent is not None:
                del node.parent.children[node.key[0]]

    def trim(self, replica: int, max_tokens: int, upto: float = math.inf) -> int:
        """Drops `replica`'s least recently stamped leaves until it holds at most `max_tokens`
        (what its LRU would keep, roughly); returns the tokens dropped. Reported evictions keep
        the tree honest; this bounds what requests that never reached the cache leave behind.
        Leaves stamped after `upto` stay (a report older than them cannot have counted them)."""
        excess = self.replica_tokens(replica) - max_tokens
        if excess <= 0:
            return 0
        held = [n for n in self._walk(self.root) if replica in n.replicas]
        leaves = [(n.replicas[replica], n) for n in held
                  if n.replicas[replica] <= upto
                  and not any(replica in c.replicas for c in n.children.values())]
        heapq.heapify(leaves)
        dropped = 0
        while dropped < excess and leaves:
            _, node = heapq.heappop(leaves)
            del node.replicas[replica]
            dropped += len(node.key)
            parent = node.parent
            if (parent is not self.root and replica in parent.replicas
                    and parent.replicas[replica] <= upto
                    and not any(replica in c.replicas for c in parent.children.values())):
                heapq.heappush(leaves, (parent.replicas[replica], parent))
        self._tokens[replica] -= dropped
        self._prune_empty(self.root)
        return dropped

    # ---- inspection --------------------------------------------------------------------------
    @staticmethod
    def _walk(top: _Node) -> Iterator[_Node]:
        """`top` and its descendants, parents before children."""
        stack = [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Self-check for tests: coverage is prefix-closed, token counts add up."""
        counted: dict[int, int] = {}
        for node in self._walk(self.root):
            if node is self.root:
                continue
            assert node.key and node.parent.children[node.key[0]] is node
            assert node.replicas or node.children, "an empty leaf was left behind"
            for replica, stamp in node.replicas.items():
                counted[replica] = counted.get(replica, 0) + len(node.key)
                if node.parent is not self.root:
                    assert node.parent.replicas.get(replica, -math.inf) >= stamp, \
                        f"replica {replica} on a node but not (as recently) on its parent"
        for replica, tokens in self._tokens.items():
            assert counted.get(replica, 0) == tokens, (replica, counted.get(replica), tokens)
