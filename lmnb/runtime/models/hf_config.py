"""A model folder's config.json as plain data, holding the values transformers' config classes
give the fields `ModelConfig.from_hf` reads, without importing those classes.

`AutoConfig.from_pretrained` imports the model's configuration module, and through transformers'
type validators its image and video utilities (torchvision and torch._dynamo where installed):
seconds of an engine's start for a JSON file. `read_config` covers the model types lmnb serves
(Llama, Mistral, Qwen2 decoders; LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video with a CLIP tower) with the
defaults of transformers 5's `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `LlavaConfig`,
`LlavaNextConfig`, `LlavaNextVideoConfig` and `CLIPVisionConfig` (their dataclass fields and
`__post_init__`s, RoPE parameters standardised as `RotaryEmbeddingConfigMixin` does), and returns
None for anything else, which the loader then reads with AutoConfig. tests/test_hf_config.py
checks the result against AutoConfig's for every config the tests have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_DEFAULT_THETA = 10_000.0
_ROPE_TYPES_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")

# Field defaults of the decoder config classes, for the fields ModelConfig.from_hf reads.
_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
              max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_parameters=None,
              attention_bias=False, mlp_bias=False, head_dim=None, dtype=None)
_MISTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_parameters=None,
                sliding_window=4096, dtype=None)
_QWEN2 = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
              max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6,
              tie_word_embeddings=False, rope_parameters=None, bos_token_id=None,
              eos_token_id=None, use_sliding_window=False, sliding_window=4096,
              max_window_layers=28, layer_types=None, dtype=None)
_CLIP_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                    hidden_act="quick_gelu", layer_norm_eps=1e-5, dtype=None)
# What LLaVA's classes build when config.json has no vision_config at all (a partial one gets
# CLIPVisionConfig's own defaults instead).
_LLAVA_VISION_WHEN_ABSENT = dict(intermediate_size=4096, hidden_size=1024, patch_size=14,
                                 image_size=336, num_hidden_layers=24, num_attention_heads=16)
_LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]

_LLAVA = dict(image_token_index=32000, projector_hidden_act="gelu",
              vision_feature_select_strategy="default", vision_feature_layer=-2,
              multimodal_projector_bias=True, tie_word_embeddings=False, dtype=None)
_LLAVA_NEXT = {**_LLAVA, "image_grid_pinpoints": None}
_LLAVA_NEXT_VIDEO = {**_LLAVA_NEXT, "image_token_index": 32001, "video_token_index": 32000,
                     "spatial_pool_mode": "average", "spatial_pool_stride": 2}


def _llama_post_init(fields: dict[str, Any]) -> None:
    if fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]


def _qwen2_post_init(fields: dict[str, Any]) -> None:
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if fields["layer_types"] is None:
        fields["layer_types"] = [
            "sliding_attention" if fields["sliding_window"] is not None
            and i >= fields["max_window_layers"] else "full_attention"
            for i in range(fields["num_hidden_layers"])]


_DECODERS: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], None]]] = {
    "llama": (_LLAMA, _llama_post_init),
    "mistral": (_MISTRAL, _llama_post_init),
    "qwen2": (_QWEN2, _qwen2_post_init),
}
_MULTIMODAL: dict[str, dict[str, Any]] = {
    "llava": _LLAVA, "llava_next": _LLAVA_NEXT, "llava_next_video": _LLAVA_NEXT_VIDEO,
}
_TEXT_DEFAULT_TYPE = "llama"
_VISION_DEFAULT_TYPE = "clip_vision_model"


class _NotCovered(Exception):
    """A config (or sub-config) whose model type this module does not cover."""


def read_config(model_dir: Path) -> dict[str, Any] | None:
    """`model_dir/config.json` with transformers' defaults applied (see the module doc); None when
    its model type is not covered."""
    return normalise(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))


def normalise(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The values transformers' config class for `raw["model_type"]` would hold; sub-configs
    (`text_config`, `vision_config`) as nested dicts. None when the model type is not covered."""
    try:
        model_type = raw.get("model_type")
        if model_type in _DECODERS:
            return _decoder(raw, model_type)
        if model_type in _MULTIMODAL:
            return _multimodal(raw, model_type)
    except _NotCovered:
        pass
    return None


def _with_dtype(defaults: Mapping[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Field defaults overlaid with config.json (explicit nulls stay null, as they do in
    transformers); a legacy `torch_dtype` fills `dtype`."""
    fields = {**defaults, **raw}
    torch_dtype = fields.pop("torch_dtype", None)
    if fields.get("dtype") is None:
        fields["dtype"] = torch_dtype
    return fields


def _decoder(raw: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    defaults, post_init = _DECODERS[model_type]
    fields = _with_dtype(defaults, raw)
    fields["model_type"] = model_type
    post_init(fields)
    _standardise_rope(fields)
    return fields


def _standardise_rope(fields: dict[str, Any]) -> None:
    """`rope_parameters` as transformers 5 holds it: the legacy `rope_scaling` (which wins) or
    `rope_parameters`, with `rope_theta` (default 10000), `rope_type` ('default') and, for scaled
    types, `original_max_position_embeddings` (default: the model's context) filled in;
    `rope_theta` and `rope_scaling` are no separate fields any more."""
    legacy = fields.pop("rope_scaling", None)
    params = dict(legacy or fields.get("rope_parameters") or {})
    if any(isinstance(value, Mapping) for value in params.values()):
        raise _NotCovered("RoPE parameters per layer type")
    params.setdefault("rope_theta", fields.pop("rope_theta", _DEFAULT_THETA))
    partial_rotary_factor = fields.pop("partial_rotary_factor", None)
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_CONTEXT:
        params.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    fields["rope_parameters"] = params


def _text_config(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    if raw is None:
        return _decoder({}, _TEXT_DEFAULT_TYPE)
    model_type = raw.get("model_type", _TEXT_DEFAULT_TYPE)
    if model_type not in _DECODERS:
        raise _NotCovered(model_type)
    return _decoder(raw, model_type)


def _vision_config(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    if raw is None:
        raw = _LLAVA_VISION_WHEN_ABSENT
    if raw.get("model_type", _VISION_DEFAULT_TYPE) != _VISION_DEFAULT_TYPE:
        raise _NotCovered(raw.get("model_type"))
    fields = _with_dtype(_CLIP_VISION, raw)
    fields["model_type"] = _VISION_DEFAULT_TYPE
    return fields


def _multimodal(raw: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    fields = _with_dtype(_MULTIMODAL[model_type], raw)
    fields["model_type"] = model_type
    fields["text_config"] = _text_config(raw.get("text_config"))
    fields["vision_config"] = _vision_config(raw.get("vision_config"))
    # `image_token_id` (and LLaVA-NeXT-Video's `video_token_id`) name the `*_index` fields;
    # config.json's extra keys are set after the fields, so the `*_id` spelling wins.
    aliases = [("image_token_id", "image_token_index")]
    if model_type == "llava_next_video":
        aliases.append(("video_token_id", "video_token_index"))
    for alias, name in aliases:
        if alias in fields:
            fields[name] = fields[alias]
        fields[alias] = fields[name]
    if model_type != "llava" and fields["image_grid_pinpoints"] is None:
        fields["image_grid_pinpoints"] = _LLAVA_NEXT_PINPOINTS
    return fields
