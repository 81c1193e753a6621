"""LLaVA-1.5, LLaVA-NeXT and LLaVA-NeXT-Video: a CLIP tower, an MLP projector and our own
Llama-family decoder (`LlamaForCausalLM`: Llama, Mistral, Qwen2).

The model protocol the runner uses (docs/structures.md):
- `embed_tokens(ids)` [n] -> [n, hidden] (text ids only);
- `embed_media(items)` -> one [item.num_tokens, hidden] tensor per `MediaItem`, in the order HF's
  models scatter features into the `<image>`/`<video>` positions of a prompt;
- `forward(input_ids, positions, forward_batch, input_embeds=None)`: the decoder, with
  `input_embeds` (text rows from `embed_tokens`, media rows spliced in) replacing the embedding;
- `compute_logits(hidden)`, `load_weights(weights)`.

Per item (HF's order of operations):
- LLaVA-1.5 image [3, S, S]: tower -> feature layer(s) -> drop CLS ('default') -> projector.
- LLaVA-NeXT image [tiles, 3, S, S] (base tile first; `image_size` = the original (h, w)):
  every tile through tower and projector, then `pack_anyres` (lmnb.multimodal.anyres
  draws the layout): base features, then the tiles' grid unpadded with a newline per row.
- LLaVA-NeXT-Video video [frames, 3, S, S]: tower -> features -> drop CLS -> spatial pooling of
  each frame's patch grid -> projector; frames one after another.
How many rows each gives: `lmnb.multimodal.anyres.num_media_tokens(config, kind, ...)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from lmnb.multimodal.anyres import (
    anyres_num_tiles,
    anyres_tile_grid,
    num_media_tokens,
    unpadded_window,
)
from lmnb.multimodal.items import MediaItem
from lmnb.runtime.config import ModelConfig, MultimodalConfig
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.models.llama import LlamaForCausalLM
from lmnb.runtime.models.registry import register_model
from lmnb.runtime.models.vision import CLIPVisionModel, activation, copy_checked
from lmnb.runtime.quantization import LLAVA_DECODER_PREFIXES

__all__ = ["LlavaForConditionalGeneration", "num_media_tokens"]

# Top-level modules of a LLaVA checkpoint besides the decoder (either layout).
_OWN_PREFIXES = ("vision_tower.", "multi_modal_projector.", "image_newline", "vision_resampler.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class SpatialPool(nn.Module):
    """LLaVA-NeXT-Video's pooling of each frame's [grid, grid] features (HF's `vision_resampler`;
    only 'conv' has weights, under `pool.`)."""

    def __init__(self, mm: MultimodalConfig, dim: int) -> None:
        super().__init__()
        stride = mm.spatial_pool_stride
        if mm.spatial_pool_mode == "average":
            self.pool = nn.AvgPool2d(kernel_size=stride, stride=stride)
        elif mm.spatial_pool_mode == "max":
            self.pool = nn.MaxPool2d(kernel_size=stride, stride=stride)
        else:
            self.pool = nn.Conv2d(dim, dim, kernel_size=stride, stride=stride)
        self.grid = mm.vision.grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [frames, grid*grid, dim]
        frames, _, dim = x.shape
        spatial = x.view(frames, self.grid, self.grid, dim).permute(0, 3, 1, 2)
        return self.pool(spatial).flatten(2).transpose(1, 2)


@register_model("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                "LlavaNextVideoForConditionalGeneration", "llava", "llava_next",
                "llava_next_video")
class LlavaForConditionalGeneration(nn.Module):
    """LLaVA-1.5 / -NeXT / -NeXT-Video over our decoder; which one follows from the config
    (`multimodal.image_grid_pinpoints`: anyres; `multimodal.spatial_pool_mode`: videos)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.multimodal is None:
            raise ValueError(f"{config.architecture!r} has no vision_config: not a LLaVA model")
        self.config = config
        self.mm = mm = config.multimodal
        if (mm.anyres or mm.supports_video) and mm.select_strategy != "default":
            raise ValueError("anyres images and videos need vision_feature_select_strategy="
                             "'default' (as in HF's models)")
        self.vision_tower = CLIPVisionModel(mm.vision, mm.feature_layers)
        feature_dim = mm.vision.hidden_size * len(mm.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            feature_dim, config.hidden_size, mm.projector_act, mm.projector_bias)
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size)) if mm.anyres else None
        self.vision_resampler = SpatialPool(mm, feature_dim) if mm.supports_video else None
        self.language_model = LlamaForCausalLM(config)

    # ---- the model protocol -----------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, forward_batch, input_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def num_media_tokens(self, kind: str, *, image_size: tuple[int, int] | None = None,
                         num_frames: int | None = None) -> int:
        return num_media_tokens(self.config, kind, image_size=image_size,
                                num_frames=num_frames)

    def embed_media(self, items: Sequence[MediaItem]) -> list[torch.Tensor]:
        """[item.num_tokens, hidden] per item (model dtype and device): every tile and frame of
        all items goes through the vision tower in one batch."""
        if not items:
            return []
        pixels, counts = [], []
        for item in items:
            tiles = self._tiles(item)
            pixels.append(tiles)
            counts.append(tiles.shape[0])
        weight = self.multi_modal_projector.linear_1.weight
        batch = torch.cat(pixels).to(device=weight.device, dtype=weight.dtype)
        features = self.vision_tower(batch)
        if self.mm.select_strategy == "default":
            features = features[:, 1:]
        out = []
        for item, item_features in zip(items, features.split(counts), strict=True):
            rows = self._item_rows(item, item_features)
            if rows.shape[0] != item.num_tokens:
                raise ValueError(f"{item.kind} gives {rows.shape[0]} embedding rows but its "
                                 f"span has {item.num_tokens} tokens")
            out.append(rows)
        return out

    def _tiles(self, item: MediaItem) -> torch.Tensor:
        """The [n, 3, S, S] pixels of an item the tower sees (padding tiles dropped)."""
        pixels = item.pixel_values
        if pixels.dim() == 3:
            pixels = pixels[None]
        if pixels.dim() != 4:
            raise ValueError(f"{item.kind} pixel_values must be [3, H, W] or [n, 3, H, W], got "
                             f"shape {tuple(pixels.shape)}")
        if item.kind == "image":
            if self.mm.anyres:
                if item.image_size is None:
                    raise ValueError("an anyres image needs its original image_size")
                tiles = anyres_num_tiles(item.image_size, self.mm.image_grid_pinpoints,
                                         self.mm.vision.image_size)
                if pixels.shape[0] < tiles:
                    raise ValueError(f"an image of size {item.image_size} has {tiles} tiles, "
                                     f"pixel_values only {pixels.shape[0]}")
                return pixels[:tiles]
            if pixels.shape[0] != 1:
                raise ValueError(f"an image is one tile here, got {pixels.shape[0]}")
            return pixels
        if item.kind == "video":
            if not self.mm.supports_video:
                raise ValueError(f"{self.config.architecture} takes no videos")
            return pixels
        raise ValueError(f"unknown media kind {item.kind!r}")

    def _item_rows(self, item: MediaItem, features: torch.Tensor) -> torch.Tensor:
        if item.kind == "video":
            return self.multi_modal_projector(self.vision_resampler(features)).flatten(0, 1)
        projected = self.multi_modal_projector(features)
        if not self.mm.anyres:
            return projected[0]
        return self.pack_anyres(projected, item.image_size)

    def pack_anyres(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """[tiles, g*g, hidden] (base tile first) -> [tokens, hidden]: base features, then the
        tiles' grid, unpadded to the image's aspect ratio, a newline embedding after each row."""
        grid = self.mm.vision.grid
        tile_rows, tile_cols = anyres_tile_grid(image_size, self.mm.image_grid_pinpoints,
                                                self.mm.vision.image_size)
        base, tiles = features[0], features[1:]
        dim = tiles.shape[-1]
        # [tile_row, tile_col, row, col, dim] -> [tile_row, row, tile_col, col, dim]
        big = tiles.view(tile_rows, tile_cols, grid, grid, dim).permute(0, 2, 1, 3, 4)
        big = big.reshape(tile_rows * grid, tile_cols * grid, dim)
        top, bottom, left, right = unpadded_window(image_size, (big.shape[0], big.shape[1]))
        big = big[top:bottom, left:right]
        newline = self.image_newline.to(big.dtype).expand(big.shape[0], 1, dim)
        return torch.cat([base, torch.cat([big, newline], dim=1).flatten(0, 1)])

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Both checkpoint layouts: transformers 5's (`model.language_model.*`,
        `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.image_newline`,
        `lm_head.*`) and the llava-hf hub's (`language_model.model.*`,
        `language_model.lm_head.*`, `vision_tower[.vision_model].*`, `multi_modal_projector.*`,
        `image_newline`)."""
        own = {name: param for name, param in self.named_parameters()
               if not name.startswith("language_model.")}
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for checkpoint_name, tensor in weights:
                name = _strip_model_prefix(checkpoint_name)
                decoder = next((checkpoint_name.removeprefix(prefix)
                                for prefix in LLAVA_DECODER_PREFIXES
                                if checkpoint_name.startswith(prefix)), None)
                if name.startswith(_OWN_PREFIXES):
                    self._load_own(name, checkpoint_name, tensor, own, loaded)
                elif name.startswith("language_model.lm_head."):
                    yield name.removeprefix("language_model."), tensor
                elif decoder is not None:
                    yield "model." + decoder, tensor
                elif name.startswith("language_model."):
                    yield "model." + name.removeprefix("language_model."), tensor
                elif name.startswith("lm_head."):
                    yield name, tensor
                else:
                    raise KeyError(f"checkpoint tensor {checkpoint_name!r} has no place in "
                                   f"{type(self).__name__}")

        self.language_model.load_weights(decoder_weights())
        missing = sorted(set(own) - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _load_own(self, name: str, checkpoint_name: str, tensor: torch.Tensor,
                  own: dict[str, nn.Parameter], loaded: set[str]) -> None:
        if name.startswith("vision_tower."):
            inner = self.vision_tower.param_name(name.removeprefix("vision_tower."))
            if inner is None:
                return
            name = "vision_tower." + inner
        if name not in own:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} has no place in "
                           f"{type(self).__name__}")
        copy_checked(own[name], tensor, checkpoint_name)
        loaded.add(name)


def _strip_model_prefix(name: str) -> str:
    """transformers 5 keeps everything but `lm_head` under `model.`."""
    if name.startswith("model."):
        rest = name.removeprefix("model.")
        if rest.startswith(("language_model.", *_OWN_PREFIXES)):
            return rest
    return name
