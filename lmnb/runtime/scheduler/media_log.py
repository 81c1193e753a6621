"""What the scheduler remembers about the media it has seen, for `Runtime.media_snapshot()` and
the cache-dashboard counters: per content hash its requests, how many found the whole span
cached, and the prompt prefixes that end with it (to ask the prefix cache whether it is still
resident)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from lmnb.multimodal.items import MediaItem, pad_token_id
from lmnb.runtime.core import Req
from lmnb.runtime.prefix_cache import PrefixCache

KEYS_PER_MEDIA = 4  # distinct prompt prefixes remembered per media (resident if any is cached)


@dataclass(slots=True)
class MediaRecord:
    hash: int
    kind: str
    num_tokens: int
    size: tuple[int, int] | None
    thumbnail: bytes | None
    requests: int = 0
    hits: int = 0
    keys: deque[tuple[tuple[int, ...], Hashable]] = field(
        default_factory=lambda: deque(maxlen=KEYS_PER_MEDIA))


class MediaLog:
    """Bounded (`capacity` most recently seen media); touched by the scheduler thread only."""

    def __init__(self, vocab_size: int, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._records: OrderedDict[int, MediaRecord] = OrderedDict()

    def admitted(self, req: Req) -> tuple[int, int]:
        """Counts a request at its first admission; returns (media tokens, of them cached)."""
        if req.mm_inputs is None or not req.mm_inputs.items:
            return 0, 0
        total = cached = 0
        for item in req.mm_inputs.items:
            total += item.num_tokens
            cached += max(0, min(req.prefix_len, item.end) - item.offset)
            record = self._record(item)
            record.requests += 1
            record.hits += req.prefix_len >= item.end
            key = (tuple(req.origin_input_ids[:item.end]), req.extra_key)
            if key in record.keys:
                record.keys.remove(key)
            record.keys.append(key)
        return total, cached

    def _record(self, item: MediaItem) -> MediaRecord:
        record = self._records.get(item.hash)
        if record is None:
            record = self._records[item.hash] = MediaRecord(
                item.hash, item.kind, item.num_tokens, item.image_size, item.thumbnail)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(item.hash)
        return record

    def pad_kinds(self) -> dict[int, tuple[str, int]]:
        """Pad id -> (kind, hash) of the media remembered (to label spans in text previews)."""
        return {pad_token_id(r.hash, self.vocab_size): (r.kind, r.hash)
                for r in self._records.values()}

    def snapshot(self, cache: PrefixCache) -> list[dict[str, Any]]:
        """One dict per media, most recent first (see `Runtime.media_snapshot`)."""
        rows = []
        for record in reversed(self._records.values()):
            resident = any(cache.cached_length(key, extra) >= len(key)
                           for key, extra in record.keys)
            rows.append({"hash": f"{record.hash:016x}", "kind": record.kind,
                         "num_tokens": record.num_tokens, "requests": record.requests,
                         "hits": record.hits, "resident": resident,
                         "thumbnail": record.thumbnail, "size": record.size})
        return rows

    def clear(self) -> None:
        self._records.clear()
