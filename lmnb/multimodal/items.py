"""What a request carries about its media: plain data, picklable, no PIL or decoder objects.

A prompt's media span is a run of `num_tokens` identical pad ids derived from the content hash
(`pad_token_id`): the radix cache then shares a span exactly when the media are the same, and
text before it as usual. Pad ids are >= the vocabulary size, so they never equal a text token;
the model runner replaces their embeddings with the media's.

The radix tree (and the disk tier's page names) key a span by its ids, and already the KV of its
first token depends on the whole picture, so two media whose pad ids agree would share it: a
pad id keeps as much of the hash as a token id can hold. Tokenizers decode u32 ids (the output
side decodes a prompt's tail, pad ids included), so that is 32 bits less the vocabulary
(SGLang keeps 30): two media behind the same text collide once in ~2**32 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ID_LIMIT = 1 << 32  # tokenizers take u32 ids


def pad_token_id(media_hash: int, vocab_size: int) -> int:
    """The id every token of a media span carries, in [vocab_size, 2**32): the hash modulo
    2**32 - vocab_size, so it depends on all of the hash's bits."""
    return vocab_size + media_hash % (ID_LIMIT - vocab_size)


@dataclass(slots=True)
class MediaItem:
    """One preprocessed image or video of a request.

    `pixel_values`: the processor's output for this item alone: image [3, H, W], anyres image
    [tiles, 3, H, W], video [frames, 3, H, W]. `offset`: index of the span's first token in the
    request's input ids (-1 until the prompt is expanded).
    """

    kind: str  # "image" | "video"
    hash: int  # 63-bit content hash of the decoded pixels (and, for video, the sampled frames)
    pixel_values: torch.Tensor
    num_tokens: int  # embedding rows = prompt tokens of its span
    image_size: tuple[int, int] | None = None  # (height, width) before preprocessing (anyres)
    offset: int = -1
    thumbnail: bytes | None = None  # small PNG for widgets

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(slots=True)
class MultimodalInputs:
    """A request's media in prompt order; spans do not overlap."""

    items: list[MediaItem] = field(default_factory=list)

    def overlapping(self, start: int, end: int) -> list[tuple[MediaItem, int, int]]:
        """(item, first row, end row) of each item's embedding rows at prompt positions
        [start, end)."""
        spans = []
        for item in self.items:
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo < hi:
                spans.append((item, lo - item.offset, hi - item.offset))
        return spans
