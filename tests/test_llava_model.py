"""Our LLaVA models against HF transformers (fp32, CPU) on tiny random-weight llava-hf folders.

Inputs come from HF's own processor (prompt ids with `<image>` expanded, pixel values, image
sizes); video frames are preprocessed one by one with the image processor (torchvision is not
installed) and HF's model gets the same `pixel_values_videos`. Ours runs one request through a
`ForwardBatch` with the torch-native backend, the `embed_media` rows spliced into
`input_embeds` at the media positions (in order, as HF's `masked_scatter` places them).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from PIL import Image

from lmnb.multimodal.anyres import num_media_tokens, select_best_resolution, unpadded_window
from lmnb.multimodal.items import MediaItem
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from tests.llava_fixtures import (
    IMAGE_TOKEN_ID,
    LLAVA_VARIANTS,
    VIDEO_TOKEN_ID,
    expand_video_token,
    hf_processor,
    make_tiny_llava,
    video_pixel_values,
)

CPU = torch.device("cpu")


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return list(rng.randint(0, 256, (count, 36, 48, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def hf_models(tiny_llavas):
    from transformers import AutoModelForImageTextToText

    return {variant: AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32).eval() for variant, folder in tiny_llavas.items()}


@pytest.fixture(scope="module")
def ours(tiny_llavas):
    built = {}
    for variant, folder in tiny_llavas.items():
        config = loader.load_model_config(folder)
        model = loader.load_model(folder, config, dtype=torch.float32, device=CPU)
        built[variant] = (model, config)
    return built


@functools.cache
def _processor(folder):
    return hf_processor(folder)


def _chat(folder, parts: list[dict]) -> str:
    return _processor(folder).tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)


def _hf_inputs(folder, images: list[Image.Image], frames=None, text: str = "What is this?"):
    """HF's processor output (plus `pixel_values_videos` for a video) for one user turn."""
    parts = [{"type": "image"} for _ in images]
    if frames is not None:
        parts.append({"type": "video"})
    prompt = _chat(folder, [*parts, {"type": "text", "text": text}])
    video = None
    if frames is not None:
        video = video_pixel_values(folder, frames)
        prompt = expand_video_token(prompt, folder, video)
    inputs = dict(_processor(folder)(images=images or None, text=prompt, return_tensors="pt"))
    if video is not None:
        inputs["pixel_values_videos"] = video[None]
    return inputs


def _items(config: ModelConfig, inputs: dict) -> list[MediaItem]:
    """Our MediaItems for HF's inputs, in prompt order (images, then the video, as the chat
    template places them), with offsets at the expanded spans."""
    ids = inputs["input_ids"][0].tolist()
    items = []
    for i in range(len(inputs.get("pixel_values", []))):
        size = tuple(inputs["image_sizes"][i].tolist()) if "image_sizes" in inputs else None
        count = num_media_tokens(config, "image", image_size=size)
        items.append(MediaItem(kind="image", hash=i, pixel_values=inputs["pixel_values"][i],
                               num_tokens=count, image_size=size))
    if "pixel_values_videos" in inputs:
        video = inputs["pixel_values_videos"][0]
        count = num_media_tokens(config, "video", num_frames=video.shape[0])
        items.append(MediaItem(kind="video", hash=99, pixel_values=video, num_tokens=count))
    for kind, token in (("image", IMAGE_TOKEN_ID), ("video", VIDEO_TOKEN_ID)):
        positions = [p for p, t in enumerate(ids) if t == token]
        of_kind = [item for item in items if item.kind == kind]
        assert len(positions) == sum(item.num_tokens for item in of_kind), \
            f"HF's processor expands {kind}s into {len(positions)} tokens"
        start = 0
        for item in of_kind:
            span = positions[start:start + item.num_tokens]
            assert span == list(range(span[0], span[0] + item.num_tokens)), "a span is contiguous"
            item.offset = span[0]
            start += item.num_tokens
    return items


class _OneRequest:
    """Our model serving one request by hand: a prefill with media rows spliced into
    `input_embeds`, then decode steps, through the runner's ForwardBatch (torch-native)."""

    def __init__(self, model, config: ModelConfig) -> None:
        self.model, self.config = model, config
        engine_config = EngineConfig(max_total_tokens=1024, max_running_requests=2,
                                     attention_backend="torch_native")
        self.runner = ModelRunner(model, config, engine_config, device=CPU,
                                  dtype=torch.float32, eos_token_ids={2})
        self.allocator = KVAllocator(1024, CPU)
        self.pool_index = self.runner.req_to_token_pool.alloc()
        self.length = 0

    def _run(self, ids: list[int], items: list[MediaItem] | None) -> torch.Tensor:
        slots = self.allocator.alloc(len(ids))
        start = self.length
        self.runner.req_to_token_pool.req_to_token[self.pool_index,
                                                   start:start + len(ids)] = slots
        mode = ForwardMode.EXTEND if items is not None else ForwardMode.DECODE
        batch = Batch(mode=mode, rids=[0], req_pool_indices=[self.pool_index],
                      prefix_lens=[start], extend_lens=[len(ids)], input_ids=list(ids),
                      out_cache_loc=slots, samples=[True])
        self.length += len(ids)
        with torch.inference_mode():
            forward_batch = self.runner.forward_batch(batch)
            self.runner.attn_backend.init_forward_metadata(forward_batch)
            embeds = None
            if items is not None:
                embeds = self.model.embed_tokens(
                    forward_batch.input_ids.clamp(max=self.config.vocab_size - 1))
                for item, rows in zip(items, self.model.embed_media(items), strict=True):
                    embeds[item.offset:item.end] = rows
            hidden = self.model(forward_batch.input_ids, forward_batch.positions,
                                forward_batch, input_embeds=embeds)
            return self.model.compute_logits(hidden)

    def prefill(self, ids: list[int], items: list[MediaItem]) -> torch.Tensor:
        return self._run(ids, items)

    def greedy(self, ids: list[int], items: list[MediaItem], new_tokens: int) -> list[int]:
        out = [int(self.prefill(ids, items)[-1].argmax())]
        while len(out) < new_tokens:
            out.append(int(self._run([out[-1]], None)[-1].argmax()))
        return out


def _check(variant, tiny_llavas, hf_models, ours, images, frames=None):
    folder = tiny_llavas[variant]
    inputs = _hf_inputs(folder, images, frames)
    with torch.no_grad():
        expected = hf_models[variant](**inputs).logits[0]
    model, config = ours[variant]
    items = _items(config, inputs)
    got = _OneRequest(model, config).prefill(inputs["input_ids"][0].tolist(), items)
    relative = ((got - expected).abs().max() / expected.abs().max()).item()
    assert relative < 1e-4, f"{variant}: relative logit error {relative:.2e}"
    return items


def test_fixture_folders_are_llava_hf_style(tiny_llavas):
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    assert sorted(tiny_llavas) == sorted(LLAVA_VARIANTS)
    for variant, folder in tiny_llavas.items():
        assert AutoImageProcessor.from_pretrained(folder) is not None
        if variant != "llava-next-video":  # its video processor needs torchvision
            assert AutoProcessor.from_pretrained(folder) is not None
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.convert_tokens_to_ids(["<image>", "<video>"]) == [49152, 49153]
        config = json.loads((folder / "config.json").read_text())
        assert config["text_config"]["vocab_size"] == 49216  # 49154 padded to 64s, as llava-hf


def test_model_config_reads_the_multimodal_fields(tiny_llavas):
    configs = {v: loader.load_model_config(f) for v, f in tiny_llavas.items()}
    plain, next_, video = (configs[v] for v in LLAVA_VARIANTS)
    assert (plain.image_token_id, plain.video_token_id) == (IMAGE_TOKEN_ID, None)
    assert plain.multimodal.vision.grid == 5 and not plain.multimodal.anyres
    assert plain.multimodal.feature_layers == (-2,)
    assert plain.multimodal.select_strategy == "default"
    assert (plain.multimodal.projector_act, plain.text_model_type) == ("gelu", "llama")
    assert next_.multimodal.image_grid_pinpoints == ((24, 48), (48, 24), (48, 48))
    assert not next_.multimodal.supports_video and next_.text_model_type == "mistral"
    assert video.video_token_id == VIDEO_TOKEN_ID and video.multimodal.supports_video
    assert (video.multimodal.spatial_pool_mode, video.multimodal.spatial_pool_stride) == (
        "average", 2)
    assert num_media_tokens(plain, "image") == 25
    assert num_media_tokens(video, "video", num_frames=3) == 12


@pytest.mark.parametrize("variant", LLAVA_VARIANTS)
def test_one_image_logits_match_hf(variant, tiny_llavas, hf_models, ours):
    _check(variant, tiny_llavas, hf_models, ours, [_image(30, 30, seed=1)])


@pytest.mark.parametrize("variant", LLAVA_VARIANTS)
def test_two_images_in_one_prompt_match_hf(variant, tiny_llavas, hf_models, ours):
    items = _check(variant, tiny_llavas, hf_models, ours,
                   [_image(40, 28, seed=2), _image(26, 64, seed=3)])
    assert items[0].end < items[1].offset


@pytest.mark.parametrize("size", [(40, 70), (70, 40), (50, 50), (20, 90), (31, 17)])
def test_anyres_image_of_any_size_matches_hf(size, tiny_llavas, hf_models, ours):
    items = _check("llava-next", tiny_llavas, hf_models, ours, [_image(*size, seed=4)])
    assert items[0].image_size == size


def test_video_matches_hf(tiny_llavas, hf_models, ours):
    items = _check("llava-next-video", tiny_llavas, hf_models, ours, [], _frames(3, seed=5))
    assert items[0].num_tokens == 3 * 4


def test_image_and_video_in_one_prompt_match_hf(tiny_llavas, hf_models, ours):
    _check("llava-next-video", tiny_llavas, hf_models, ours, [_image(44, 30, seed=6)],
           _frames(2, seed=7))


@pytest.mark.parametrize("variant", LLAVA_VARIANTS)
def test_greedy_continuation_matches_hf_generate(variant, tiny_llavas, hf_models, ours):
    folder = tiny_llavas[variant]
    frames = _frames(2, seed=9) if variant == "llava-next-video" else None
    inputs = _hf_inputs(folder, [_image(34, 52, seed=8)], frames)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = hf_models[variant].generate(**inputs, max_new_tokens=8, min_new_tokens=8,
                                          do_sample=False, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    model, config = ours[variant]
    assert _OneRequest(model, config).greedy(ids, _items(config, inputs), 8) == expected


def test_image_token_counts_match_hf_processor(tiny_llavas, ours):
    """Our counts equal what HF's processor expands `<image>` into, over many sizes."""
    processor = _processor(tiny_llavas["llava-next"])
    _, config = ours["llava-next"]
    rng = np.random.RandomState(0)
    for _ in range(40):
        height, width = (int(v) for v in rng.randint(8, 120, size=2))
        hf_count = processor._get_num_multimodal_tokens(
            image_sizes=[(height, width)])["num_image_tokens"][0]
        assert num_media_tokens(config, "image", image_size=(height, width)) == hf_count


def test_anyres_geometry_matches_hf_helpers():
    import transformers.models.llava_next.modeling_llava_next as hf

    rng = np.random.RandomState(1)
    pinpoints = [[24, 48], [48, 24], [48, 48], [72, 24]]
    for _ in range(200):
        size = tuple(int(v) for v in rng.randint(1, 200, size=2))
        assert select_best_resolution(size, pinpoints) == hf.select_best_resolution(
            list(size), pinpoints)
        grid = tuple(int(v) for v in rng.randint(1, 20, size=2))
        top, bottom, left, right = unpadded_window(size, grid)
        unpadded = hf.unpad_image(torch.zeros(1, *grid), list(size))
        assert unpadded.shape[1:] == (bottom - top, right - left)


@pytest.mark.parametrize("overrides", [
    {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"},
    {"vision_feature_layer": -1, "projector_hidden_act": "gelu_pytorch_tanh"},
])
def test_feature_layers_strategy_and_projector_act_follow_the_config(overrides, tmp_path,
                                                                     smollm2_dir):
    from transformers import AutoModelForImageTextToText

    folder = make_tiny_llava(tmp_path, "llava-1.5", smollm2_dir, overrides=overrides)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=CPU)
    inputs = _hf_inputs(folder, [_image(30, 40, seed=11)])
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    items = _items(config, inputs)
    full = overrides.get("vision_feature_select_strategy") == "full"
    assert items[0].num_tokens == 25 + full  # 'full' keeps the CLS position
    got = _OneRequest(model, config).prefill(inputs["input_ids"][0].tolist(), items)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


@pytest.mark.parametrize("layout", ["state_dict", "hub"])
def test_both_checkpoint_layouts_load(layout, tmp_path, smollm2_dir, ours):
    from safetensors import safe_open

    variant = "llava-next-video"  # newline, resampler-free pooling, every top-level module
    folder = make_tiny_llava(tmp_path, variant, smollm2_dir, layout=layout)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    prefix = {"state_dict": "model.language_model.", "hub": "language_model.model."}[layout]
    assert any(name.startswith(prefix) for name in names)
    if layout == "hub":
        assert any(name.startswith("vision_tower.vision_model.") for name in names)
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=CPU)
    reference, _ = ours[variant]  # the same seed, saved the save_pretrained way
    for (name, param), (_, want) in zip(model.state_dict().items(),
                                        reference.state_dict().items(), strict=True):
        assert torch.equal(param, want), name


def test_missing_or_stray_tensors_are_named(tiny_llavas):
    folder = tiny_llavas["llava-1.5"]
    config = loader.load_model_config(folder)
    weights = list(loader.iter_safetensors(folder))
    model = loader.load_model(None, config, dtype=torch.float32, device=CPU, dummy=True)
    with pytest.raises(KeyError, match="lacks"):
        model.load_weights([w for w in weights if "multi_modal_projector.linear_2" not in w[0]])
    with pytest.raises(KeyError, match="no place"):
        model.load_weights([*weights, ("vision_tower.extra.weight", torch.zeros(1))])


def test_embed_media_rejects_a_wrong_span(tiny_llavas, ours):
    model, config = ours["llava-1.5"]
    item = MediaItem(kind="image", hash=0, pixel_values=torch.zeros(3, 30, 30), num_tokens=24)
    with pytest.raises(ValueError, match="25 embedding rows but its span has 24"):
        model.embed_media([item])
    with pytest.raises(ValueError, match="takes no videos"):
        model.embed_media([MediaItem(kind="video", hash=0, pixel_values=torch.zeros(2, 3, 30, 30),
                                     num_tokens=8)])
