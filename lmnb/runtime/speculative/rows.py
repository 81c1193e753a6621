"""A multi-token pass as decode rows: the layout that lets speculative verify passes and a draft
model's catch-up passes replay the decode CUDA graphs.

A request that feeds n tokens after `start` cached ones becomes n consecutive rows; row j holds
token j, writes its KV to that token's slot and reads the request's KV row up to position
start + j (its own slot included):

    request   pool p, start s, tokens t_0 .. t_{n-1}
    row j     req_pool_index p, prefix_len s + j, extend_len 1, input t_j

The slots of all n tokens are in the request's `req_to_token` row before the pass, and every
layer writes the pass's K/V before it attends, so row j sees t_0 .. t_j: the causal attention of
one EXTEND over the n tokens, with decode metadata (one query a row). Rows of one request read
the same prefix; they form a shared-prefix group (read once per tile) where the prefix is long.
A decode graph of any batch size >= the row count replays the pass (padding rows attend to the
padding slot), whatever the requests' draft lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SHARED_PREFIX_MIN_TOKENS = 64  # a prefix worth reading once per group (one KV tile)


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """Per-row host lists of a pass laid out as decode rows."""

    req_pool_indices: list[int]
    prefix_lens: list[int]
    shared_prefixes: list[tuple[int, list[int]]]  # (prefix length, rows) groups

    @property
    def size(self) -> int:
        return len(self.req_pool_indices)


def decode_rows(req_pool_indices: Sequence[int], prefix_lens: Sequence[int],
                extend_lens: Sequence[int], *, shared_prefix: bool) -> DecodeRows:
    """The rows of requests feeding `extend_lens[i]` tokens after `prefix_lens[i]` cached ones
    (`shared_prefix`: group each request's rows when its prefix is long enough)."""
    pools: list[int] = []
    prefix: list[int] = []
    shared: list[tuple[int, list[int]]] = []
    for pool, start, n in zip(req_pool_indices, prefix_lens, extend_lens, strict=True):
        if shared_prefix and n > 1 and start >= SHARED_PREFIX_MIN_TOKENS:
            shared.append((start, list(range(len(pools), len(pools) + n))))
        pools.extend([pool] * n)
        prefix.extend(range(start, start + n))
    return DecodeRows(pools, prefix, shared)


def last_rows(extend_lens: Sequence[int]) -> list[int]:
    """The row of each request's last token."""
    rows: list[int] = []
    end = 0
    for n in extend_lens:
        end += n
        rows.append(end - 1)
    return rows
