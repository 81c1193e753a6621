"""Model classes by HF architecture name: `@register_model(...)` and `model_class(config)`.

Lookups read a `ModelConfig`'s `architecture` and `model_type` (any object with both works).
Whether a class shards over tensor-parallel ranks is said when it registers (`tensor_parallel`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_MODELS: dict[str, type] = {}
_TENSOR_PARALLEL: set[type] = set()  # registered classes that `tp_size > 1` shards

# Modules that register the built-in models; imported on the first lookup that misses.
_BUILTIN_MODULES = ("lmnb.runtime.models.llama", "lmnb.runtime.models.llava")

# Configs without `architectures` (or with an unregistered one) fall back to their model_type.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",
}


def register_model(*architectures: str, tensor_parallel: bool = False
                   ) -> Callable[[type], type]:
    """Class decorator: serve configs whose `architecture` (or model_type) is one of these;
    `tensor_parallel=True`: the class shards over `tp_size > 1` ranks (models/layers/linear.py)."""
    if not architectures:
        raise TypeError("register_model() needs at least one architecture name")

    def decorate(cls: type) -> type:
        for name in architectures:
            _MODELS[name] = cls
        if tensor_parallel:
            _TENSOR_PARALLEL.add(cls)
        return cls

    return decorate


def _import_builtin_models() -> None:
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def _candidates(config: Any) -> list[str]:
    names = [config.architecture] if config.architecture else []
    model_type = config.model_type
    if model_type:
        names.append(model_type)
        if model_type in _MODEL_TYPE_ARCHITECTURES:
            names.append(_MODEL_TYPE_ARCHITECTURES[model_type])
    return names


def model_class(config: Any) -> type:
    """The registered class for `config.architecture`, else for `config.model_type`."""
    names = _candidates(config)
    if not any(name in _MODELS for name in names):
        _import_builtin_models()
    for name in names:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(
        f"unsupported model: architecture={config.architecture!r}, "
        f"model_type={config.model_type!r}; "
        f"supported: {', '.join(sorted(_MODELS)) or 'none registered'}"
    )


def supports_tensor_parallel(cls: type) -> bool:
    """Whether `cls` was registered with `tensor_parallel=True`."""
    return cls in _TENSOR_PARALLEL
