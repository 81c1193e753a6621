"""Content hashes of decoded media: the same picture gives the same hash whatever it came from (a
file, a PIL object, an array, bytes in another container format), so the radix cache shares its
KV; any pixel that differs gives another hash."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

HASH_BITS = 63
_MASK = (1 << HASH_BITS) - 1


def _digest(kind: str, pixels: np.ndarray) -> int:
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    h = hashlib.blake2b(digest_size=8)
    h.update(kind.encode())
    h.update(repr(tuple(pixels.shape)).encode())
    h.update(memoryview(pixels).cast("B"))
    return int.from_bytes(h.digest(), "little") & _MASK


def image_hash(image: Image.Image | np.ndarray) -> int:
    """63-bit hash of an RGB image's pixels (a PIL image or a uint8 array [H, W, 3])."""
    pixels = image if isinstance(image, np.ndarray) else np.asarray(image.convert("RGB"))
    return _digest("image", pixels)


def video_hash(frames: np.ndarray) -> int:
    """63-bit hash of a video's sampled frames [F, H, W, 3] (their count is part of the shape;
    an image and a one-frame video of it differ)."""
    return _digest("video", frames)
