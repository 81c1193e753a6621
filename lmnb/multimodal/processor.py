"""`MediaProcessor`: a multimodal model's media side, from its folder alone.

Images go through transformers' own image processor of the folder (`AutoImageProcessor`: the
Pil classes, torchvision is not installed); a video's sampled frames go one by one through a
CLIP-style image processor configured from the folder's video processor config (what
LLaVA-NeXT-Video's video processor does: resize the shortest edge, center crop, normalize).
`num_tokens` counts the prompt tokens of an item as HF's processor does, with the model's own
count (`lmnb.multimodal.anyres.num_media_tokens`), so it is the number of embedding rows the
model's `embed_media` returns.

`expand` replaces each `<image>` / `<video>` token of a prompt with its item's span of pad ids
(`pad_token_id(hash, vocab_size)`), so the radix cache shares a span exactly when the media are
the same.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmnb.multimodal.anyres import num_media_tokens
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

if TYPE_CHECKING:
    from transformers.image_processing_utils import BaseImageProcessor

    from lmnb.runtime.config import ModelConfig

DEFAULT_NUM_FRAMES = 8
RECENT_ITEMS = 32  # preprocessed media kept by hash: a repeated picture skips preprocessing
_FRAME_KEYS = ("size", "crop_size", "do_resize", "do_center_crop", "do_rescale", "rescale_factor",
               "do_normalize", "image_mean", "image_std", "resample", "do_convert_rgb")


class MediaProcessor:
    """Loads, hashes and preprocesses a request's images and videos for one model."""

    def __init__(self, *, image_processor: BaseImageProcessor,
                 frame_processor: BaseImageProcessor | None,
                 count_tokens: Callable[..., int], vocab_size: int, image_token_id: int | None,
                 video_token_id: int | None, anyres: bool) -> None:
        """`count_tokens(kind, image_size=(h, w), num_frames=n)`: prompt tokens of an item."""
        self.image_processor = image_processor
        self.frame_processor = frame_processor
        self.count_tokens = count_tokens
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.anyres = anyres
        self._recent: OrderedDict[tuple[str, int], MediaItem] = OrderedDict()
        self._lock = threading.Lock()  # `image`/`video` run on the callers' threads

    @classmethod
    def from_model_dir(cls, model_dir: str | Path,
                       model_config: ModelConfig) -> MediaProcessor | None:
        """The processor of a multimodal model folder (`model_config`: its `ModelConfig`, whose
        `multimodal` describes the vision side); None for a text model."""
        mm = model_config.multimodal
        if mm is None:
            return None
        from functools import partial

        from transformers import AutoImageProcessor

        folder = Path(model_dir)
        video_token = mm.video_token_id if mm.supports_video else None
        return cls(image_processor=AutoImageProcessor.from_pretrained(folder,
                                                                      local_files_only=True),
                   frame_processor=_frame_processor(folder) if video_token is not None else None,
                   count_tokens=partial(num_media_tokens, model_config),
                   vocab_size=int(model_config.vocab_size), image_token_id=mm.image_token_id,
                   video_token_id=video_token, anyres=mm.anyres)

    # ---- items ---------------------------------------------------------------------------------
    def image(self, source: ImageSource) -> MediaItem:
        """One image: loaded (RGB), hashed, preprocessed; `pixel_values` [3, H, W], or
        [tiles, 3, H, W] for anyres models."""
        if self.image_token_id is None:
            raise MediaError("this model takes no images")
        image = load_image(source)
        media_hash = image_hash(image)
        seen = self._seen("image", media_hash)
        if seen is not None:
            return seen
        size = (image.height, image.width)
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"][0]
        if self.anyres and "image_sizes" in out:
            size = tuple(int(v) for v in out["image_sizes"][0].tolist())
        return self._remember(MediaItem(
            kind="image", hash=media_hash, pixel_values=pixels.contiguous(),
            num_tokens=self.count_tokens("image", image_size=size), image_size=size,
            thumbnail=thumbnail_png(image)))

    def video(self, source: VideoSource, num_frames: int = DEFAULT_NUM_FRAMES) -> MediaItem:
        """One video: `num_frames` frames sampled uniformly over the clip, hashed, each frame
        preprocessed; `pixel_values` [frames, 3, H, W]."""
        if self.video_token_id is None or self.frame_processor is None:
            raise MediaError("this model takes no videos")
        frames, _total = load_video(source, num_frames)
        media_hash = video_hash(frames)
        seen = self._seen("video", media_hash)
        if seen is not None:
            return seen
        from PIL import Image

        images = [Image.fromarray(frame) for frame in frames]
        pixels = self.frame_processor(images=images, return_tensors="pt")["pixel_values"]
        middle = images[len(images) // 2]
        return self._remember(MediaItem(
            kind="video", hash=media_hash, pixel_values=pixels.contiguous(),
            num_tokens=self.count_tokens("video", num_frames=len(images)),
            image_size=(int(frames.shape[1]), int(frames.shape[2])),
            thumbnail=thumbnail_png(middle)))

    def _seen(self, kind: str, media_hash: int) -> MediaItem | None:
        """A fresh item (its own offset) sharing the pixels of a recently preprocessed one."""
        with self._lock:
            item = self._recent.get((kind, media_hash))
            if item is None:
                return None
            self._recent.move_to_end((kind, media_hash))
        return _copy(item)

    def _remember(self, item: MediaItem) -> MediaItem:
        with self._lock:
            self._recent[(item.kind, item.hash)] = item
            while len(self._recent) > RECENT_ITEMS:
                self._recent.popitem(last=False)
        return _copy(item)

    def item(self, kind: str,
             source: ImageSource | VideoSource | MediaItem | dict[str, Any]) -> MediaItem:
        """An item from what `Runtime.generate` accepts per image/video: a source, a `MediaItem`
        (copied, so one item may serve several prompts), or for videos a dict
        `{"video": source, "num_frames": n}`."""
        if isinstance(source, MediaItem):
            if source.kind != kind:
                raise MediaError(f"a {source.kind} item was given as {kind} data")
            return _copy(source)
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


def _copy(item: MediaItem) -> MediaItem:
    """The same media as a new item (offset unset); tensors and thumbnail are shared."""
    return MediaItem(item.kind, item.hash, item.pixel_values, item.num_tokens, item.image_size,
                     -1, item.thumbnail)


def _frame_processor(folder: Path) -> BaseImageProcessor:
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

