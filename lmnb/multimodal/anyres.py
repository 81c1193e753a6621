"""LLaVA's media geometry without torch: anyres tiling, unpadding, and how many prompt tokens an
image or a video takes (`num_media_tokens`), exactly as HF transformers' models count them.

The processor side expands each `<image>`/`<video>` into `num_media_tokens(...)` pad tokens; the
model's `embed_media` returns that many rows, so the two can never disagree.

LLaVA-NeXT ("anyres"): the image is resized (aspect kept) and padded into the best of
`image_grid_pinpoints`, cut into tiles of the tower's size, and a downscaled base tile is added.
Its features are the base tile's patches, then the tiles' patch grid joined into one big grid,
cropped back to the image's aspect ratio ("unpadded"), with an `image_newline` after each row:

    base (g*g rows) | row 0 of the unpadded grid, newline | row 1, newline | ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmnb.runtime.config import ModelConfig, MultimodalConfig


def select_best_resolution(image_size: tuple[int, int],
                           pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps most of the image's resolution, then
    wastes least (HF's `select_best_resolution`, ties to the first)."""
    height, width = image_size
    best, best_effective, best_wasted = None, 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        down_width, down_height = int(width * scale), int(height * scale)
        effective = min(down_width * down_height, width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


def anyres_tile_grid(image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]],
                     tile_size: int) -> tuple[int, int]:
    """(rows, columns) of tiles an image of `image_size` (height, width) is cut into."""
    height, width = select_best_resolution(image_size, pinpoints)
    return height // tile_size, width // tile_size


def anyres_num_tiles(image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]],
                     tile_size: int) -> int:
    """Tiles the vision tower sees for one anyres image, the base tile included."""
    rows, cols = anyres_tile_grid(image_size, pinpoints, tile_size)
    return rows * cols + 1


def unpadded_window(image_size: tuple[int, int], grid_size: tuple[int, int]
                    ) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the part of a (rows, cols) feature grid covering the image
    itself, without the padding that fitted it into the pinpoint (HF's `unpad_image`)."""
    height, width = image_size
    rows, cols = grid_size
    if width / height > cols / rows:  # wider than the grid: padding above and below
        new_rows = int(round(height * (cols / width), 7))
        pad = (rows - new_rows) // 2
        return pad, rows - pad, 0, cols
    new_cols = int(round(width * (rows / height), 7))
    pad = (cols - new_cols) // 2
    return 0, rows, pad, cols - pad


def _features_per_tile(mm: MultimodalConfig) -> int:
    grid = mm.vision.grid
    return grid * grid + (1 if mm.select_strategy == "full" else 0)


def num_image_tokens(mm: MultimodalConfig, image_size: tuple[int, int] | None = None) -> int:
    """Prompt tokens of one image for a `MultimodalConfig`; `image_size` (height, width) of the
    original image is needed for anyres (LLaVA-NeXT) models."""
    if not mm.anyres:
        return _features_per_tile(mm)
    if image_size is None:
        raise ValueError("an anyres (LLaVA-NeXT) model needs the image's size to count its tokens")
    if mm.select_strategy != "default":
        raise ValueError("anyres images need vision_feature_select_strategy='default'")
    grid = mm.vision.grid
    tile_rows, tile_cols = anyres_tile_grid(image_size, mm.image_grid_pinpoints,
                                            mm.vision.image_size)
    top, bottom, left, right = unpadded_window(image_size, (tile_rows * grid, tile_cols * grid))
    rows, cols = bottom - top, right - left
    return grid * grid + rows * (cols + 1)  # base tile + unpadded grid with a newline per row


def pooled_grid(mm: MultimodalConfig) -> int:
    """Side of one video frame's feature grid after LLaVA-NeXT-Video's spatial pooling."""
    stride = mm.spatial_pool_stride
    return (mm.vision.grid - stride) // stride + 1  # kernel = stride, no padding


def num_video_tokens(mm: MultimodalConfig, num_frames: int) -> int:
    """Prompt tokens of a video of `num_frames` frames (LLaVA-NeXT-Video: pooled frames).

    HF's processor counts `grid*grid // 4 * frames`; that equals this (the model's count) for
    stride-2 pooling of an even grid, as in every released checkpoint."""
    if not mm.supports_video:
        raise ValueError("this model takes no videos")
    if mm.select_strategy != "default":
        raise ValueError("videos need vision_feature_select_strategy='default'")
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    side = pooled_grid(mm)
    return num_frames * side * side


def num_media_tokens(config: ModelConfig, kind: str, *, image_size: tuple[int, int] | None = None,
                     num_frames: int | None = None) -> int:
    """Prompt tokens an image (`kind='image'`, `image_size` = original (height, width), needed
    for anyres) or a video (`kind='video'`, `num_frames`) takes in a model of `config` (a
    `ModelConfig` whose `multimodal` is set): exactly the rows `embed_media` returns, and what
    HF's processors expand `<image>`/`<video>` into."""
    mm = config.multimodal
    if mm is None:
        raise ValueError(f"{config.architecture!r} is not a multimodal model")
    if kind == "image":
        return num_image_tokens(mm, image_size)
    if kind == "video":
        if num_frames is None:
            raise ValueError("counting a video's tokens needs num_frames")
        return num_video_tokens(mm, num_frames)
    raise ValueError(f"unknown media kind {kind!r} (image, video)")
