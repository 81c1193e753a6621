"""`MediaProcessor` on the tiny llava-hf folders against HF's own processors: the same pixel values
and the same number of `<image>` tokens for every variant and odd image sizes; videos' frames
and token counts; prompt expansion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lmnb.multimodal.items import MediaItem, pad_token_id
from lmnb.multimodal.media import MediaError
from lmnb.multimodal.processor import MediaProcessor
from lmnb.runtime.models import loader
from tests.llava_fixtures import (
    IMAGE_TOKEN_ID,
    LLAVA_VARIANTS,
    VIDEO_TOKEN,
    VIDEO_TOKEN_ID,
    expand_video_token,
    hf_processor,
    video_pixel_values,
)

SIZES = [(24, 24), (30, 30), (1, 1), (17, 203), (203, 17), (300, 451), (451, 300), (47, 49),
         (99, 100), (48, 24), (25, 49)]


@pytest.fixture(scope="module")
def processors(tiny_llavas) -> dict[str, MediaProcessor]:
    out = {}
    for variant, folder in tiny_llavas.items():
        config = loader.load_model_config(folder)
        out[variant] = MediaProcessor.from_model_dir(folder, config)
    return out


def random_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3),
                                                                dtype=np.uint8))


@pytest.mark.parametrize("variant", LLAVA_VARIANTS)
def test_images_match_hf_processor(variant, tiny_llavas, processors):
    processor = processors[variant]
    hf = hf_processor(tiny_llavas[variant])
    for size in SIZES:
        image = random_image(size)
        item = processor.image(image)
        out = hf(text="a <image> b", images=[image], return_tensors="pt")
        assert item.num_tokens == out["input_ids"][0].tolist().count(IMAGE_TOKEN_ID), size
        assert torch.equal(item.pixel_values, out["pixel_values"][0]), size
        assert item.image_size == size and item.kind == "image" and item.offset == -1


def test_the_same_picture_is_one_hash_whatever_its_source(tmp_path, processors):
    processor = processors["llava-1.5"]
    image = random_image((40, 60))
    path = tmp_path / "p.png"
    image.save(path)
    items = [processor.image(s) for s in (image, str(path), path.read_bytes(), np.asarray(image))]
    assert len({item.hash for item in items}) == 1
    assert all(torch.equal(item.pixel_values, items[0].pixel_values) for item in items)
    assert processor.image(random_image((40, 60), seed=1)).hash != items[0].hash
    # A repeated picture is preprocessed once: new items (own offsets) share its pixels.
    assert items[1].pixel_values is items[0].pixel_values and items[1] is not items[0]
    items[0].offset = 3
    assert processor.image(image).offset == -1


def test_video_frames_and_tokens(tiny_llavas, processors):
    processor = processors["llava-next-video"]
    frames = np.random.default_rng(0).integers(0, 255, (12, 36, 50, 3), dtype=np.uint8)
    item = processor.video(frames, num_frames=5)
    expected = video_pixel_values(tiny_llavas["llava-next-video"], list(frames[[0, 3, 6, 8,
                                                                                 11]]))
    assert torch.equal(item.pixel_values, expected)
    hf_text = expand_video_token(VIDEO_TOKEN, tiny_llavas["llava-next-video"], expected)
    assert item.num_tokens == hf_text.count(VIDEO_TOKEN)  # HF's LlavaNextVideoProcessor count
    assert item.kind == "video" and item.image_size == (36, 50)
    assert item.thumbnail.startswith(b"\x89PNG")
    with pytest.raises(MediaError, match="no videos"):
        processors["llava-next"].video(frames)
    via_dict = processor.item("video", {"video": frames, "num_frames": 5})
    assert via_dict.hash == item.hash and via_dict is not item
    with pytest.raises(MediaError, match="keys"):
        processor.item("video", {"path": frames})


def test_expand_replaces_media_tokens_with_spans(processors):
    processor = processors["llava-next-video"]
    vocab = processor.vocab_size
    image = processor.image(random_image((30, 40)))
    video = processor.video(np.zeros((3, 24, 24, 3), np.uint8), num_frames=3)
    ids = [5, IMAGE_TOKEN_ID, 6, VIDEO_TOKEN_ID, 7]
    out = processor.expand(ids, [video, image])  # grouped by kind: order within a kind counts
    assert image.offset == 1 and video.offset == 2 + image.num_tokens
    assert out == ([5] + [pad_token_id(image.hash, vocab)] * image.num_tokens + [6]
                   + [pad_token_id(video.hash, vocab)] * video.num_tokens + [7])
    assert all(t >= vocab for t in out[1:1 + image.num_tokens])
    with pytest.raises(MediaError, match="1 image token.*2 image"):
        processor.expand(ids, [image, image, video])
    with pytest.raises(MediaError, match="0 image token"):
        processor.expand([5, 6], [image])
    copy = processor.item("image", image)
    assert isinstance(copy, MediaItem) and copy is not image and copy.offset == -1
    with pytest.raises(MediaError, match="given as video"):
        processor.item("video", image)


def test_text_models_have_no_processor(tiny_models):
    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    assert MediaProcessor.from_model_dir(folder, config) is None
