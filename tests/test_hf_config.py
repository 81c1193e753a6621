"""config.json read as plain data (`models/hf_config.py`) gives the `ModelConfig` that AutoConfig
gives, for every config.json the tests and benchmarks have and for partial ones (class defaults,
legacy keys, explicit nulls); uncovered model types go through AutoConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.dummy_models import DUMMY_CONFIGS
from lmnb.runtime.config import ModelConfig
from lmnb.runtime.models import hf_config, loader

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0}
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "image_size": 30, "patch_size": 6}
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 1000}

# Hand-written config.json contents: what hub folders hold (transformers 4 keys), partial ones
# that lean on the classes' defaults, and explicit nulls.
RAW_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-bare": {"model_type": "llama"},
    "llama-nulls": {"model_type": "llama", "num_key_value_heads": None, "head_dim": None,
                    "bos_token_id": None, "rope_theta": None},
    "llama-3.1-rope-scaling": {**DUMMY_CONFIGS["llama-3-8b"], "rope_scaling": {
        **_LLAMA3_ROPE, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16", "dtype": None},
    "llama3-rope-without-original-context": {"model_type": "llama", "rope_theta": 500000.0,
                                             "rope_scaling": dict(_LLAMA3_ROPE),
                                             "original_max_position_embeddings": 4096},
    "llama-linear-rope-legacy-type": {"model_type": "llama",
                                      "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama-rope-parameters-v5": {"model_type": "llama", "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
    "llama-legacy-rope-scaling-wins": {"model_type": "llama", "rope_theta": 20000.0,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                       "rope_parameters": {"rope_type": "dynamic",
                                                           "factor": 3.0}},
    "llama-partial-rotary-and-biases": {"model_type": "llama", "partial_rotary_factor": 0.5,
                                        "attention_bias": True, "mlp_bias": True,
                                        "head_dim": 256, "torch_dtype": "float16"},
    "mistral-bare": {"model_type": "mistral"},
    "mistral-head-dim-null": {"model_type": "mistral", "head_dim": None,
                              "num_attention_heads": 16, "architectures": ["MistralForCausalLM"]},
    "mistral-window": {"model_type": "mistral", "sliding_window": 512},
    "qwen2-bare": {"model_type": "qwen2"},
    "qwen2-window-on-upper-layers": {"model_type": "qwen2", "use_sliding_window": True,
                                     "sliding_window": 256, "max_window_layers": 20},
    "qwen2-window-on-no-layer": {"model_type": "qwen2", "use_sliding_window": True,
                                 "max_window_layers": 32},
    "qwen2-extras": {"model_type": "qwen2", "head_dim": 64, "attention_bias": False,
                     "use_sliding_window": True, "quantization_config": None},
    "llava-no-subconfigs": {"model_type": "llava"},
    "llava-partial-vision": {"model_type": "llava", "vision_config": {"hidden_size": 48},
                             "text_config": {"model_type": "llama", **_TEXT},
                             "image_token_index": 7, "torch_dtype": "float16",
                             "image_grid_pinpoints": [[336, 672]]},
    "llava-image-token-id-wins": {"model_type": "llava", "vision_config": dict(_VISION),
                                  "text_config": {**_TEXT, "model_type": "mistral",
                                                  "num_key_value_heads": 2},
                                  "image_token_index": 5, "image_token_id": 9,
                                  "vision_feature_layer": [-3, -1],
                                  "vision_feature_select_strategy": "full"},
    "llava-next-defaults": {"model_type": "llava_next", "vision_config": {
        **_VISION, "image_size": 336, "patch_size": 14}, "text_config": {
        "model_type": "qwen2", **_TEXT, "num_key_value_heads": 4},
        "multimodal_projector_bias": False},
    "llava-next-video-aliases": {"model_type": "llava_next_video", "vision_config": dict(_VISION),
                                 "text_config": dict(_TEXT), "video_token_id": 3,
                                 "image_token_index": 4, "spatial_pool_stride": 3,
                                 "image_grid_pinpoints": [[30, 60]]},
    "llava-next-video-defaults": {"model_type": "llava_next_video",
                                  "vision_config": {"model_type": "clip_vision_model",
                                                    "image_size": 336, "patch_size": 14}},
}


def _write(folder: Path, fields: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def _assert_same(folder: Path) -> None:
    fields = hf_config.read_config(folder)
    assert fields is not None, f"{folder.name}: model type not covered"
    expected = ModelConfig.from_hf(loader.load_config(folder).to_dict())
    assert ModelConfig.from_hf(fields) == expected
    assert loader.load_model_config(folder) == expected


@pytest.mark.parametrize("name", sorted(RAW_CONFIGS))
def test_hand_written_configs_match_autoconfig(tmp_path: Path, name: str) -> None:
    _assert_same(_write(tmp_path / name, RAW_CONFIGS[name]))


def test_benchmark_and_test_configs_match_autoconfig(tmp_path: Path, smollm2_dir: Path,
                                                     tiny_models: dict[str, Path],
                                                     tiny_llavas: dict[str, Path]) -> None:
    """bench/dummy_models.py's architectures, the tiny test models', the LLaVA test folders' and
    the embedded SmolLM2's config.json."""
    folders = [_write(tmp_path / name, fields) for name, fields in DUMMY_CONFIGS.items()]
    folders += [*tiny_models.values(), *tiny_llavas.values(), smollm2_dir]
    for folder in folders:
        if (folder / "config.json").is_file():  # LMNB_TOKENIZER_DIR may name a bare tokenizer
            _assert_same(folder)


@pytest.mark.parametrize("fields", [
    {"model_type": "gpt2"},
    {"architectures": ["LlamaForCausalLM"]},  # no model_type: AutoConfig guesses from the path
    {"model_type": "llava", "vision_config": {"model_type": "siglip_vision_model"}},
    {"model_type": "llava", "text_config": {"model_type": "gemma"}},
    {"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}},
])
def test_uncovered_configs_are_left_to_autoconfig(fields: dict[str, Any]) -> None:
    assert hf_config.normalise(fields) is None


def test_autoconfig_fallback_serves_uncovered_model_types(tmp_path: Path) -> None:
    folder = _write(tmp_path / "qwen3", {"model_type": "qwen3", **_TEXT, "num_key_value_heads": 2,
                                         "max_position_embeddings": 128})
    config = loader.load_model_config(folder)
    assert config == ModelConfig.from_hf(loader.load_config(folder).to_dict())
    assert (config.model_type, config.max_position_embeddings, config.num_kv_heads) == (
        "qwen3", 128, 2)


@pytest.mark.parametrize(("fields", "context"), [
    ({"model_type": "mistral"}, 4096),  # MistralConfig's default window
    ({"model_type": "mistral", "sliding_window": None}, 4096 * 32),
    ({"model_type": "mistral", "sliding_window": 512, "max_position_embeddings": 256}, 256),
    ({"model_type": "qwen2", "sliding_window": 256}, 32768),  # use_sliding_window is off
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256}, 256),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256,
      "max_window_layers": 32}, 32768),  # no layer at or past max_window_layers slides
    ({"model_type": "llama", "sliding_window": 256}, 2048),  # Llama has no window
])
def test_a_sliding_window_bounds_the_context(tmp_path: Path, fields: dict[str, Any],
                                             context: int) -> None:
    """lmnb attends to the whole context: it serves a windowed model up to its window, where
    the two agree, as vLLM does for models it runs without the window."""
    folder = _write(tmp_path / "model", fields)
    _assert_same(folder)
    assert loader.load_model_config(folder).context_length == context
