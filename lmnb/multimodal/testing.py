"""LLaVA folders without a model hub: random weights of a real architecture, in the llava-hf
layout, for demos, examples and benchmarks (no CLIP/SigLIP weights exist in any package).

    from lmnb.multimodal.testing import tiny_llava
    folder = tiny_llava("/tmp/llava")          # LLaVA-NeXT-Video, a few MB, random weights
    rt = lmnb.Runtime(folder)

A folder holds what a llava-hf hub folder holds: `config.json`, `model.safetensors` (unless
`weights=False`: then load it with `Runtime(folder, load_format="dummy")`), the tokenizer with
`<image>` and `<video>` added, a chat template that writes an image part as "<image>\\n" (as
llava-hf's templates do) around the tokenizer's own turns, `preprocessor_config.json` (the image
processor), `processor_config.json`, and for LLaVA-NeXT-Video `video_preprocessor_config.json`.

The text it generates is meaningless; what it shows is real: token counts, the vision tower run
once per image, and image/video KV reuse in the radix cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

VARIANTS = ("llava-1.5", "llava-next", "llava-next-video")
IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"

# The geometry of llava-hf/llava-1.5-7b-hf's tower (CLIP ViT-L/14 at 336 px: 576 tokens an
# image) with tiny widths; LLaVA-NeXT tiles of 336 px on a grid of up to 2x2.
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=4, projection_dim=32, image_size=336, patch_size=14)
TINY_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192)
GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672]]
_ARCHITECTURES = {"llava-1.5": "LlavaForConditionalGeneration",
                  "llava-next": "LlavaNextForConditionalGeneration",
                  "llava-next-video": "LlavaNextVideoForConditionalGeneration"}

# llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336 and Llama-2-7B.
CLIP_VIT_L_14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, projection_dim=768, image_size=336,
                         patch_size=14, hidden_act="quick_gelu")
LLAMA_2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=4096, rms_norm_eps=1e-5)


def chat_template() -> str:
    """ChatML (SmolLM2's turns) with llava-hf's handling of content parts: a message whose
    content is a list renders its images ("<image>\\n" each), then its videos, then its text;
    a string content is kept as it is (so a prompt may also carry `<image>` in its text)."""
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
        "{{ '<image>\\n' }}{% endfor %}"
        "{% for part in message['content'] | selectattr('type', 'equalto', 'video') %}"
        "{{ '<video>\\n' }}{% endfor %}"
        "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
        "{{ part['text'] }}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer(tokenizer_dir: str | Path | None) -> Any:
    from transformers import AutoTokenizer

    from lmnb.runtime.models.loader import resolve_model_dir

    # A folder of tokenizer files alone will do (a GPU machine without the embedded model).
    folder = resolve_model_dir(None) if tokenizer_dir is None else Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, VIDEO_TOKEN]})
    tokenizer.chat_template = chat_template()
    return tokenizer


def llava_config(variant: str, *, text: dict[str, Any], vision: dict[str, Any],
                 vocab_size: int, image_token_id: int, video_token_id: int,
                 bos_token_id: int | None, eos_token_id: int | None,
                 grid_pinpoints: list[list[int]] | None = None,
                 overrides: dict[str, Any] | None = None) -> Any:
    """The HF config of a LLaVA `variant` with these text and vision (CLIP) fields, LLaVA-NeXT's
    anyres `grid_pinpoints` (default GRID_PINPOINTS) and top-level `overrides` (e.g.
    `vision_feature_layer=[-3, -1]`, `vision_feature_select_strategy="full"`)."""
    from transformers import (
        AutoConfig,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaNextConfig,
        LlavaNextVideoConfig,
    )

    fields = dict(text)
    text_config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields,
                                       vocab_size=vocab_size, bos_token_id=bos_token_id,
                                       eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    vision_config = CLIPVisionConfig(**vision)
    side = vision_config.image_size // vision_config.patch_size
    common = dict(vision_config=vision_config, text_config=text_config,
                  image_token_id=image_token_id, vision_feature_layer=-2,
                  vision_feature_select_strategy="default", projector_hidden_act="gelu",
                  image_seq_length=side * side)
    common.update(overrides or {})
    pinpoints = grid_pinpoints or GRID_PINPOINTS
    if variant == "llava-1.5":
        return LlavaConfig(**common)
    if variant == "llava-next":
        return LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)
    return LlavaNextVideoConfig(**common, image_grid_pinpoints=pinpoints,
                                video_token_id=video_token_id, spatial_pool_mode="average",
                                spatial_pool_stride=2, video_seq_length=(side // 2) ** 2)


def _save_processor(target: Path, variant: str, config: Any, tokenizer: Any) -> None:
    from transformers import (
        CLIPImageProcessorPil,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    vision = config.vision_config
    size = {"shortest_edge": vision.image_size}
    crop = {"height": vision.image_size, "width": vision.image_size}
    common = dict(tokenizer=tokenizer, patch_size=vision.patch_size,
                  vision_feature_select_strategy=config.vision_feature_select_strategy,
                  num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    if variant == "llava-1.5":
        image_processor = CLIPImageProcessorPil(size=size, crop_size=crop)
        processor = LlavaProcessor(image_processor=image_processor, **common)
    else:
        image_processor = LlavaNextImageProcessorPil(
            size=size, crop_size=crop, image_grid_pinpoints=config.image_grid_pinpoints)
        processor = LlavaNextProcessor(image_processor=image_processor, **common)
    processor.save_pretrained(target)
    image_processor.save_pretrained(target)  # preprocessor_config.json, as on the hub
    if variant == "llava-next-video":
        # What LlavaNextVideoVideoProcessor saves (it needs torchvision to be built): frames are
        # resized and center-cropped like images, each on its own.
        video = {"video_processor_type": "LlavaNextVideoVideoProcessor", "size": size,
                 "crop_size": crop, "do_resize": True, "do_center_crop": True,
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": list(image_processor.image_mean),
                 "image_std": list(image_processor.image_std), "do_convert_rgb": True,
                 "resample": 3}
        (target / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
        processor_file = target / "processor_config.json"
        saved = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
        saved.update(processor_class="LlavaNextVideoProcessor", video_token=VIDEO_TOKEN)
        processor_file.write_text(json.dumps(saved, indent=2) + "\n")


def build_llava(target: str | Path, *, variant: str = "llava-next-video",
                text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
                tokenizer_dir: str | Path | None = None, seed: int = 0,
                weights: bool = True, dtype: str = "float32",
                grid_pinpoints: list[list[int]] | None = None,
                overrides: dict[str, Any] | None = None) -> Path:
    """Writes a random-weight llava-hf folder of `variant` ("llava-1.5", "llava-next",
    "llava-next-video") with these text-model and CLIP-tower fields (default: tiny) into
    `target` (replacing it) and returns it. The tokenizer comes from `tokenizer_dir` (default:
    the embedded SmolLM2's) with `<image>` and `<video>` added; the text vocabulary covers it.
    `weights=False` writes no weights: load with `load_format="dummy"` (GPU benchmarks).
    `grid_pinpoints`, `overrides`: as `llava_config` takes them."""
    import torch

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    target = Path(target)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    tokenizer = _tokenizer(tokenizer_dir)
    image_id, video_id = tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, VIDEO_TOKEN])
    vocab = -(-len(tokenizer) // 64) * 64  # padded, as llava-hf pads Llama's 32000 to 32064
    config = llava_config(variant, text=text or TINY_TEXT, vision=vision or TINY_VISION,
                          vocab_size=vocab, image_token_id=image_id, video_token_id=video_id,
                          bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          grid_pinpoints=grid_pinpoints, overrides=overrides)
    config.dtype = dtype
    tokenizer.save_pretrained(target)
    if weights:
        from transformers import (
            LlavaForConditionalGeneration,
            LlavaNextForConditionalGeneration,
            LlavaNextVideoForConditionalGeneration,
        )

        cls = {"llava-1.5": LlavaForConditionalGeneration,
               "llava-next": LlavaNextForConditionalGeneration,
               "llava-next-video": LlavaNextVideoForConditionalGeneration}[variant]
        assert cls.__name__ == _ARCHITECTURES[variant]
        torch.manual_seed(seed)
        model = cls(config).to(getattr(torch, dtype)).eval()
        with torch.no_grad():  # spread the tiny random init, so greedy ties are unlikely
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.normal_(0.0, 0.08)
        _quiet_save(model, target)
    else:
        config.architectures = [_ARCHITECTURES[variant]]
        config.save_pretrained(target)
    _save_processor(target, variant, config, tokenizer)
    return target


def _quiet_save(model: Any, target: Path) -> None:
    """`save_pretrained` without its progress bar (a notebook cell would keep it)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(target)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def tiny_llava(target: str | Path, variant: str = "llava-next-video", *, seed: int = 0,
               tokenizer_dir: str | Path | None = None) -> Path:
    """A tiny random-weight LLaVA folder (a few MB; fp32; fast on a CPU) with llava-hf's real
    image geometry: 336 px tiles of 14 px patches, so 576 tokens an image for LLaVA-1.5, and
    LLaVA-NeXT's anyres tiles (up to 2x2) and 144 tokens a video frame for LLaVA-NeXT-Video."""
    return build_llava(target, variant=variant, seed=seed, tokenizer_dir=tokenizer_dir)
