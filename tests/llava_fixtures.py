"""Tiny random-weight llava-hf folders (LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video) for tests.

No CLIP weights exist offline: every model here is a random-weight miniature of the real
architecture, with SmolLM2's real tokenizer plus the added special tokens `<image>` and `<video>`
(ids 49152 and 49153; the text vocabulary covers them). A folder holds what a llava-hf hub folder
holds: config.json, model.safetensors, the tokenizer files, `preprocessor_config.json` (the image
processor), `processor_config.json` (HF's processor: patch size, select strategy, ...), the
chat template, and for LLaVA-NeXT-Video `video_preprocessor_config.json`, so that
`AutoImageProcessor.from_pretrained(folder)` and `AutoProcessor.from_pretrained(folder)`
work offline (LLaVA-NeXT-Video's `AutoProcessor` needs torchvision; `hf_processor(folder)` gives
its image part without). torchvision is not installed: transformers picks the `*Pil` image
processors, and its video processors cannot run; a video's frames are preprocessed one by one
with a CLIP-style image processor (`video_pixel_values`), giving the [frames, 3, H, W] tensor HF's
models take as `pixel_values_videos[0]`; `expand_video_token` repeats `<video>` as HF's
LLaVA-NeXT-Video processor does.

Sizes: LLaVA-1.5's tower sees 30x30 images in 6x6 patches (25 image tokens); LLaVA-NeXT and
-Video see 24x24 tiles (4x4 patches) with anyres grids of up to 48x48; NeXT-Video pools each
frame's 4x4 features to 2x2 (4 tokens a frame).

Checkpoint layouts (`layout=`): "save_pretrained" (what transformers 5 writes:
`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`, `image_newline`), "state_dict" (the in-memory names of transformers 5:
`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.image_newline`, `lm_head.*`) and "hub" (the llava-hf hub repos: like save_pretrained, with
the vision tower under `vision_tower.vision_model.*`). HF loads all three.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 49152, 49153  # SmolLM2's vocabulary is 49152 tokens
LLAVA_VARIANTS = ("llava-1.5", "llava-next", "llava-next-video")
LAYOUTS = ("save_pretrained", "state_dict", "hub")

# ChatML (SmolLM2's own turns) with media placed as llava-hf's templates place them: a message
# whose content is a list of parts renders its images, then its videos, then its text; a plain
# string content is copied as is (so a prompt may also carry `<image>` in its text).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024, vocab_size=VIDEO_TOKEN_ID + 1,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               projection_dim=32)
GRID_PINPOINTS = [[24, 48], [48, 24], [48, 48]]

# variant -> (text model_type, text overrides, vision overrides)
_SHAPES = {
    "llava-1.5": ("llama", {}, {"image_size": 30, "patch_size": 6}),
    "llava-next": ("mistral", {"num_key_value_heads": 2, "sliding_window": None},
                   {"image_size": 24, "patch_size": 6}),
    "llava-next-video": ("qwen2", {"num_key_value_heads": 2},
                         {"image_size": 24, "patch_size": 6, "hidden_act": "gelu"}),
}


def _tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, VIDEO_TOKEN]})
    assert tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, VIDEO_TOKEN]) == [IMAGE_TOKEN_ID,
                                                                           VIDEO_TOKEN_ID]
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _hf_model(variant: str, seed: int, overrides: dict | None = None):
    from transformers import (
        AutoConfig,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
    )

    text_type, text_overrides, vision_overrides = _SHAPES[variant]
    text = AutoConfig.for_model(text_type, **{**_TEXT, **text_overrides})
    vision = CLIPVisionConfig(**{**_VISION, **vision_overrides})
    common = dict(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                  vision_feature_layer=-2, vision_feature_select_strategy="default",
                  projector_hidden_act="gelu")
    common.update(overrides or {})
    grid = vision.image_size // vision.patch_size
    if variant == "llava-1.5":
        config = LlavaConfig(**common, image_seq_length=grid * grid)
        cls = LlavaForConditionalGeneration
    elif variant == "llava-next":
        config = LlavaNextConfig(**common, image_grid_pinpoints=GRID_PINPOINTS,
                                 image_seq_length=grid * grid)
        cls = LlavaNextForConditionalGeneration
    else:
        config = LlavaNextVideoConfig(**common, video_token_id=VIDEO_TOKEN_ID,
                                      image_grid_pinpoints=GRID_PINPOINTS,
                                      spatial_pool_mode="average", spatial_pool_stride=2,
                                      image_seq_length=grid * grid,
                                      video_seq_length=(grid // 2) ** 2)
        cls = LlavaNextVideoForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():  # random init is tiny; spread the logits so greedy ties are unlikely
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    return model


def _processor(variant: str, model, tokenizer):
    from transformers import (
        CLIPImageProcessorPil,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    vision = model.config.vision_config
    size, crop = ({"shortest_edge": vision.image_size},
                  {"height": vision.image_size, "width": vision.image_size})
    common = dict(tokenizer=tokenizer, patch_size=vision.patch_size,
                  vision_feature_select_strategy=model.config.vision_feature_select_strategy,
                  num_additional_image_tokens=1,
                  chat_template=CHAT_TEMPLATE)
    if variant == "llava-1.5":
        return LlavaProcessor(image_processor=CLIPImageProcessorPil(size=size, crop_size=crop),
                              **common)
    image_processor = LlavaNextImageProcessorPil(size=size, crop_size=crop,
                                                 image_grid_pinpoints=GRID_PINPOINTS)
    return LlavaNextProcessor(image_processor=image_processor, **common)


def _save_video_processor(target: Path, model) -> None:
    """LLaVA-NeXT-Video's processor files, written by hand: without torchvision transformers
    cannot build its video processor, hence not its `LlavaNextVideoProcessor` either (with
    torchvision, `AutoProcessor.from_pretrained(folder)` builds both from these files)."""
    import json

    from transformers.models.llava_next_video.video_processing_llava_next_video import (
        LlavaNextVideoVideoProcessor,  # constructible without torchvision, not callable
    )

    vision = model.config.vision_config
    video_processor = LlavaNextVideoVideoProcessor(
        size={"shortest_edge": vision.image_size},
        crop_size={"height": vision.image_size, "width": vision.image_size})
    video_processor.save_pretrained(target)  # video_preprocessor_config.json
    config_file = target / "processor_config.json"
    config = json.loads(config_file.read_text())
    config.update(processor_class="LlavaNextVideoProcessor", video_token=VIDEO_TOKEN)
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _layout_names(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`state` (transformers 5's in-memory names) renamed into a checkpoint layout."""
    if layout == "state_dict":
        return dict(state)
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name.startswith("lm_head."):
            name = "language_model." + name
        elif name.startswith("model.vision_tower."):
            rest = name.removeprefix("model.vision_tower.")
            name = "vision_tower." + ("vision_model." + rest if layout == "hub" else rest)
        else:
            name = name.removeprefix("model.")
        renamed[name] = tensor
    return renamed


def make_tiny_llava(root: Path, variant: str, tokenizer_dir: Path, seed: int = 0,
                    layout: str = "save_pretrained", overrides: dict | None = None,
                    name: str | None = None) -> Path:
    """Saves a random-weight llava-hf style folder of `variant` into `root/name` (default
    `<variant>[-<layout>]`, the suffix only for a layout other than "save_pretrained") and
    returns it. `overrides`: top-level config fields (e.g. `vision_feature_layer=[-3, -1]`,
    `vision_feature_select_strategy="full"`)."""
    from safetensors.torch import save_file

    if variant not in LLAVA_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {LLAVA_VARIANTS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    name = name or (variant if layout == "save_pretrained" else f"{variant}-{layout}")
    target = Path(root) / name
    shutil.rmtree(target, ignore_errors=True)
    tokenizer = _tokenizer(Path(tokenizer_dir))
    model = _hf_model(variant, seed, overrides)
    model.save_pretrained(target)
    if layout != "save_pretrained":
        for file in target.glob("model*.safetensors*"):
            file.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(_layout_names(state, layout), str(target / "model.safetensors"),
                  metadata={"format": "pt"})
    processor = _processor(variant, model, tokenizer)
    processor.save_pretrained(target)
    processor.image_processor.save_pretrained(target)  # preprocessor_config.json, as on the hub
    if variant == "llava-next-video":
        _save_video_processor(target, model)
    return target


def frame_processor(folder: Path):
    """The CLIP-style image processor that preprocesses a video's frames one by one (resize
    the shortest edge, center crop, normalize), configured from the folder's video processor
    config (LLaVA-NeXT-Video) or its image processor config."""
    import json

    from transformers import CLIPImageProcessorPil

    folder = Path(folder)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            break
    else:
        raise FileNotFoundError(f"no video or image processor config in {folder}")
    keys = ("size", "crop_size", "do_resize", "do_center_crop", "do_rescale", "rescale_factor",
            "do_normalize", "image_mean", "image_std", "resample", "do_convert_rgb")
    return CLIPImageProcessorPil(**{k: config[k] for k in keys if k in config})


def video_pixel_values(folder: Path, frames) -> torch.Tensor:
    """[frames, 3, H, W] float32 for a list of HxWx3 uint8 frames (numpy arrays or PIL images)."""
    processor = frame_processor(folder)
    out = processor(images=list(frames), return_tensors="pt")
    return out["pixel_values"]


def hf_processor(folder: Path):
    """HF's processor of a folder: `AutoProcessor` where it can be built without torchvision,
    LLaVA-NeXT's (images only) for LLaVA-NeXT-Video."""
    import json

    from transformers import AutoProcessor, LlavaNextProcessor

    config = json.loads((Path(folder) / "processor_config.json").read_text())
    if config.get("processor_class") == "LlavaNextVideoProcessor":
        return LlavaNextProcessor.from_pretrained(folder)
    return AutoProcessor.from_pretrained(folder)


def expand_video_token(text: str, folder: Path, pixel_values_video: torch.Tensor) -> str:
    """`text` with its (single) `<video>` repeated as HF's `LlavaNextVideoProcessor` repeats it
    for a video of these preprocessed frames [frames, 3, H, W] (HF's own counting code)."""
    import json
    from types import SimpleNamespace

    from transformers import LlavaNextVideoProcessor

    config = json.loads((Path(folder) / "processor_config.json").read_text())
    owner = SimpleNamespace(patch_size=config["patch_size"], video_token=VIDEO_TOKEN)
    span = LlavaNextVideoProcessor.replace_video_token(
        owner, {"pixel_values_videos": pixel_values_video[None].numpy()}, 0)
    assert text.count(VIDEO_TOKEN) == 1, "one <video> per prompt here"
    return text.replace(VIDEO_TOKEN, span)
