"""`MediaProcessor`: a multimodal model's media side, from its folder alone.

Images go through transformers' own image processor of the folder (`AutoImageProcessor`: the
Pil classes, torchvision is not installed); a video's sampled frames go one by one through a
CLIP-style image processor configured from the folder's video processor config (what
LLaVA-NeXT-Video's video processor does: resize the shortest edge, center crop, normalize).
`num_tokens` counts the prompt tokens of an item as HF's processor does, which is also the number
of embedding rows the model's `embed_media` returns.

`expand` replaces each `<image>` / `<video>` token of a prompt with its item's span of pad ids
(`pad_token_id(hash, vocab_size)`), so the radix cache shares a span exactly when the media are
the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmnb.multimodal.hashing import image_hash, video_hash
from lmnb.multimodal.items import MediaItem, pad_token_id
from lmnb.multimodal.media import (
    ImageSource,
    MediaError,
    VideoSource,
    load_image,
    load_video,
    thumbnail_png,
)

DEFAULT_NUM_FRAMES = 8
_FRAME_KEYS = ("size", "crop_size", "do_resize", "do_center_crop", "do_rescale", "rescale_factor",
               "do_normalize", "image_mean", "image_std", "resample", "do_convert_rgb")


def select_best_resolution(size: tuple[int, int],
                           candidates: Sequence[Sequence[int]]) -> tuple[int, int]:
    """LLaVA-NeXT's anyres grid choice for an image of `size` (h, w): the candidate (h, w) that
    keeps the most of the image's pixels when it is scaled to fit, then wastes the least."""
    height, width = size
    best, best_effective, best_wasted = None, -1, float("inf")
    for cand_h, cand_w in candidates:
        scale = min(cand_w / width, cand_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = cand_h * cand_w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(cand_h), int(cand_w)), effective, wasted
    assert best is not None
    return best


def anyres_unpadded_grid(size: tuple[int, int], grid_h: int, grid_w: int) -> tuple[int, int]:
    """The (rows, cols) of the anyres feature grid [grid_h, grid_w] left after removing the rows
    or columns that only hold the padding of an image of `size` (h, w)."""
    height, width = size
    if width / height > grid_w / grid_h:  # wider than the grid: padding rows above and below
        new_h = int(round(height * (grid_w / width), 7))
        pad = (grid_h - new_h) // 2
        return grid_h - 2 * pad, grid_w
    new_w = int(round(width * (grid_h / height), 7))
    pad = (grid_w - new_w) // 2
    return grid_h, grid_w - 2 * pad


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """How many prompt tokens (= embedding rows) an image or a video takes, from the model's
    vision geometry: `tile` px square tiles in `patch` px patches; `full` keeps the CLS feature
    ('full' select strategy); `grid_pinpoints` (anyres, LLaVA-NeXT) adds the unpadded tile grid
    with one newline row each; videos pool each frame's patch grid by `pool_stride`."""

    tile: int
    patch: int
    full: bool = False
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    pool_stride: int = 2

    @property
    def side(self) -> int:
        return self.tile // self.patch

    def image(self, size: tuple[int, int]) -> int:
        base = self.side * self.side + (1 if self.full else 0)
        if not self.grid_pinpoints:
            return base
        best_h, best_w = select_best_resolution(size, self.grid_pinpoints)
        rows, cols = anyres_unpadded_grid(size, self.side * (best_h // self.tile),
                                          self.side * (best_w // self.tile))
        return base + rows * cols + rows

    def video(self, num_frames: int) -> int:
        pooled = self.side // self.pool_stride  # HF's average pool (floor)
        return num_frames * pooled * pooled

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> TokenCounts:
        vision = hf_config.vision_config
        pinpoints = getattr(hf_config, "image_grid_pinpoints", None)
        model_type = getattr(hf_config, "model_type", "")
        return cls(tile=int(vision.image_size), patch=int(vision.patch_size),
                   full=getattr(hf_config, "vision_feature_select_strategy", "default") == "full",
                   grid_pinpoints=(tuple((int(h), int(w)) for h, w in pinpoints)
                                   if pinpoints and model_type != "llava" else None),
                   pool_stride=int(getattr(hf_config, "spatial_pool_stride", 2) or 2))


class MediaProcessor:
    """Loads, hashes and preprocesses a request's images and videos for one model."""

    def __init__(self, *, image_processor: Any, frame_processor: Any, counts: TokenCounts,
                 vocab_size: int, image_token_id: int | None, video_token_id: int | None,
                 anyres: bool) -> None:
        self.image_processor = image_processor
        self.frame_processor = frame_processor
        self.counts = counts
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.anyres = anyres

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, model_config: Any) -> MediaProcessor | None:
        """The processor of a multimodal model folder; None for a text model."""
        if model_config is None or not getattr(model_config, "is_multimodal", False):
            return None
        from transformers import AutoConfig, AutoImageProcessor

        folder = Path(model_dir)
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if getattr(hf_config, "vision_config", None) is None:
            return None
        image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
        image_token = getattr(model_config, "image_token_id", None)
        if image_token is None:
            image_token = _config_id(hf_config, "image_token_id", "image_token_index")
        video_token = getattr(model_config, "video_token_id", None)
        if video_token is None:
            video_token = _config_id(hf_config, "video_token_id", "video_token_index")
        counts = TokenCounts.from_hf_config(hf_config)
        return cls(image_processor=image_processor,
                   frame_processor=_frame_processor(folder) if video_token is not None else None,
                   counts=counts, vocab_size=int(model_config.vocab_size),
                   image_token_id=image_token, video_token_id=video_token,
                   anyres=counts.grid_pinpoints is not None)

    # ---- items ---------------------------------------------------------------------------------
    def image(self, source: ImageSource) -> MediaItem:
        """One image: loaded (RGB), hashed, preprocessed; `pixel_values` [3, H, W], or
        [tiles, 3, H, W] for anyres models."""
        if self.image_token_id is None:
            raise MediaError("this model takes no images")
        image = load_image(source)
        size = (image.height, image.width)
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"][0]
        if self.anyres and "image_sizes" in out:
            size = tuple(int(v) for v in out["image_sizes"][0].tolist())
        return MediaItem(kind="image", hash=image_hash(image), pixel_values=pixels.contiguous(),
                         num_tokens=self.counts.image(size), image_size=size,
                         thumbnail=thumbnail_png(image))

    def video(self, source: VideoSource, num_frames: int = DEFAULT_NUM_FRAMES) -> MediaItem:
        """One video: `num_frames` frames sampled uniformly over the clip, hashed, each frame
        preprocessed; `pixel_values` [frames, 3, H, W]."""
        if self.video_token_id is None or self.frame_processor is None:
            raise MediaError("this model takes no videos")
        frames, _total = load_video(source, num_frames)
        from PIL import Image

        images = [Image.fromarray(frame) for frame in frames]
        pixels = self.frame_processor(images=images, return_tensors="pt")["pixel_values"]
        middle = images[len(images) // 2]
        return MediaItem(kind="video", hash=video_hash(frames), pixel_values=pixels.contiguous(),
                         num_tokens=self.counts.video(len(images)),
                         image_size=(int(frames.shape[1]), int(frames.shape[2])),
                         thumbnail=thumbnail_png(middle))

    def item(self, kind: str, source: Any) -> MediaItem:
        """An item from what `Runtime.generate` accepts per image/video: a source, a `MediaItem`
        (copied, so one item may serve several prompts), or for videos a dict
        `{"video": source, "num_frames": n}`."""
        if isinstance(source, MediaItem):
            if source.kind != kind:
                raise MediaError(f"a {source.kind} item was given as {kind} data")
            return MediaItem(source.kind, source.hash, source.pixel_values, source.num_tokens,
                             source.image_size, -1, source.thumbnail)
        if kind == "image":
            return self.image(source)
        if isinstance(source, dict):
            unknown = set(source) - {"video", "num_frames"}
            if "video" not in source or unknown:
                raise MediaError("a video given as a dict needs the keys 'video' and optionally "
                                 f"'num_frames', got {sorted(source)}")
            return self.video(source["video"], source.get("num_frames", DEFAULT_NUM_FRAMES))
        return self.video(source)

    # ---- prompts -------------------------------------------------------------------------------
    def expand(self, input_ids: Sequence[int], items: Sequence[MediaItem]) -> list[int]:
        """`input_ids` with each image / video token replaced by the span of its item (images and
        videos each in prompt order; `items` in prompt order overall or grouped by kind, the
        order within a kind is what counts). Sets each item's `offset`. A count mismatch is a
        `MediaError`."""
        by_kind: dict[str, list[MediaItem]] = {"image": [], "video": []}
        for item in items:
            by_kind[item.kind].append(item)
        tokens = {"image": self.image_token_id, "video": self.video_token_id}
        found = {kind: sum(1 for t in input_ids if token is not None and t == token)
                 for kind, token in tokens.items()}
        for kind, listed in by_kind.items():
            if found[kind] != len(listed):
                token = tokens[kind]
                raise MediaError(
                    f"the prompt has {found[kind]} {kind} token(s) (id {token}) but "
                    f"{len(listed)} {kind}(s) were given" if token is not None else
                    f"this model takes no {kind}s")
        out: list[int] = []
        next_item = {"image": iter(by_kind["image"]), "video": iter(by_kind["video"])}
        for token in input_ids:
            kind = ("image" if token == self.image_token_id and token is not None else
                    "video" if token == self.video_token_id and token is not None else None)
            if kind is None:
                out.append(token)
                continue
            item = next(next_item[kind])
            item.offset = len(out)
            out.extend([pad_token_id(item.hash, self.vocab_size)] * item.num_tokens)
        return out


def _config_id(hf_config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


def _frame_processor(folder: Path) -> Any:
    """The per-frame image processor: CLIP-style, from the video processor config when the
    folder has one (else the image processor config without anyres)."""
    from transformers import CLIPImageProcessorPil

    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            break
    else:
        path = folder / "processor_config.json"
        config = json.loads(path.read_text()).get("image_processor", {}) if path.is_file() else {}
    return CLIPImageProcessorPil(**{k: config[k] for k in _FRAME_KEYS if k in config})

