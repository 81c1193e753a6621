"""Tiny random-weight llava-hf folders (LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video) for tests, built
by `lmnb.multimodal.testing.build_llava` with smaller images than its defaults.

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

from pathlib import Path

import torch

from lmnb.multimodal.testing import build_llava

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 49152, 49153  # SmolLM2's vocabulary is 49152 tokens
LLAVA_VARIANTS = ("llava-1.5", "llava-next", "llava-next-video")
LAYOUTS = ("save_pretrained", "state_dict", "hub")

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               projection_dim=32)
GRID_PINPOINTS = [[24, 48], [48, 24], [48, 48]]

# variant -> (text fields, vision fields)
_SHAPES = {
    "llava-1.5": ({"model_type": "llama"}, {"image_size": 30, "patch_size": 6}),
    "llava-next": ({"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": None},
                   {"image_size": 24, "patch_size": 6}),
    "llava-next-video": ({"model_type": "qwen2", "num_key_value_heads": 2},
                         {"image_size": 24, "patch_size": 6, "hidden_act": "gelu"}),
}


def _layout_name(name: str, layout: str) -> str:
    """A tensor name of the save_pretrained layout in `layout`."""
    if layout == "hub":
        return ("vision_tower.vision_model." + name.removeprefix("vision_tower.")
                if name.startswith("vision_tower.") else name)
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    return "model." + name


def _rewrite_layout(folder: Path, layout: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(weights)
    save_file({_layout_name(name, layout): tensor for name, tensor in state.items()},
              str(weights), metadata={"format": "pt"})


def make_tiny_llava(root: Path, variant: str, tokenizer_dir: Path, seed: int = 0,
                    layout: str = "save_pretrained", overrides: dict | None = None,
                    name: str | None = None) -> Path:
    """Saves a random-weight llava-hf style folder of `variant` into `root/name` (default
    `<variant>[-<layout>]`, the suffix only for a layout other than "save_pretrained") and
    returns it. `overrides`: top-level config fields (e.g. `vision_feature_layer=[-3, -1]`,
    `vision_feature_select_strategy="full"`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    name = name or (variant if layout == "save_pretrained" else f"{variant}-{layout}")
    text, vision = _SHAPES[variant]
    folder = build_llava(Path(root) / name, variant=variant, text={**_TEXT, **text},
                         vision={**_VISION, **vision}, tokenizer_dir=tokenizer_dir, seed=seed,
                         grid_pinpoints=GRID_PINPOINTS, overrides=overrides)
    if layout != "save_pretrained":
        _rewrite_layout(folder, layout)
    return folder


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
