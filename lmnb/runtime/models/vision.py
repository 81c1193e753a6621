"""CLIP's vision transformer (the tower of LLaVA-1.5 and LLaVA-NeXT), parameter names as HF's
`CLIPVisionModel` so checkpoint tensors load under their own names.

Only the layers up to the deepest feature layer are built: LLaVA reads the second-to-last layer,
so the last layer (and `post_layernorm`) of the checkpoint are never used and not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lmnb.runtime.config import VisionConfig

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": nn.functional.gelu,
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
    "silu": nn.functional.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.grid ** 2 + 1, config.hidden_size)
        self.image_size = config.image_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"the vision tower takes {self.image_size}x{self.image_size} "
                             f"images, got {height}x{width}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(batch, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim))


class CLIPMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionModel(nn.Module):
    """`forward(pixel_values [n, 3, S, S], feature_layers)` -> [n, 1 + patches, dim * k]: the
    hidden states at `feature_layers` (HF's indexing: 0 = embeddings after `pre_layrnorm`,
    i = output of layer i, negative from the end of the full tower) concatenated per position."""

    def __init__(self, config: VisionConfig, feature_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.config = config
        self.feature_layers = tuple(self._absolute(layer) for layer in feature_layers)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, max(self.feature_layers))

    def _absolute(self, layer: int) -> int:
        return layer if layer >= 0 else self.config.num_layers + 1 + layer

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)

    def param_name(self, name: str) -> str | None:
        """This tower's parameter for a checkpoint name relative to the tower (HF's
        `embeddings.*`, `encoder.layers.N.*`, ..., with or without a leading `vision_model.`);
        None for tensors it does not use (unbuilt layers, `post_layernorm`, position ids)."""
        name = name.removeprefix("vision_model.")
        if name.startswith("post_layernorm.") or name.endswith("position_ids"):
            return None
        if name.startswith("encoder.layers.") and int(name.split(".")[2]) >= len(
                self.encoder.layers):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for checkpoint_name, tensor in weights:
            name = self.param_name(checkpoint_name)
            if name is None:
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {checkpoint_name!r} has no place in the "
                               "vision tower")
            copy_checked(params[name], tensor, checkpoint_name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} vision tower tensors, "
                           f"e.g. {missing[:3]}")


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
