"""Media embeddings by content hash: the vision tower runs once per new image or video, even when
chunked prefill splits its span over several passes or later requests repeat it while part of
its KV was evicted. LRU, bounded by bytes; one owner thread (the model runner's)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from lmnb.multimodal.items import MediaItem

DEFAULT_CAPACITY_BYTES = 512 << 20

EmbedFn = Callable[[list[MediaItem]], list[torch.Tensor]]


def _key(item: MediaItem) -> tuple[str, int, int]:
    return (item.kind, item.hash, item.num_tokens)


class EmbeddingCache:
    """`get(items, embed)` returns each item's embeddings [num_tokens, hidden], calling `embed`
    once for the items it does not hold (deduplicated). Entries larger than the capacity are
    returned but not kept. Counters: `runs` (items embedded, i.e. vision-tower runs per item),
    `hits`, `evictions`."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.runs = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: MediaItem) -> bool:
        return _key(item) in self._entries

    def get(self, items: Sequence[MediaItem], embed: EmbedFn) -> list[torch.Tensor]:
        found: dict[tuple[str, int, int], torch.Tensor] = {}
        missing: list[MediaItem] = []
        for item in items:
            key = _key(item)
            if key in found or any(_key(m) == key for m in missing):
                continue
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                found[key] = cached
            else:
                missing.append(item)
        if missing:
            outputs = embed(missing)
            if len(outputs) != len(missing):
                raise RuntimeError(f"embed_media returned {len(outputs)} tensors for "
                                   f"{len(missing)} items")
            self.runs += len(missing)
            for item, out in zip(missing, outputs, strict=True):
                if out.shape[0] != item.num_tokens:
                    raise RuntimeError(f"embed_media gave {out.shape[0]} rows for a {item.kind} "
                                       f"of {item.num_tokens} tokens")
                found[_key(item)] = out
                self._put(_key(item), out)
        return [found[_key(item)] for item in items]

    def _put(self, key: tuple[str, int, int], value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.capacity_bytes:
            return
        while self._entries and self.bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = value
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
