"""Attention backends by name: `@register_attention_backend(name)`, `attention_backend_class`."""

from __future__ import annotations

from collections.abc import Callable

_BACKENDS: dict[str, type] = {}


def register_attention_backend(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return register


def attention_backend_class(name: str) -> type:
    if name == "torch_native":
        from lmnb.runtime.kernels import torch_native  # noqa: F401
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]
