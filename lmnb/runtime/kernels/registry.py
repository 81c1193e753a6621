"""Attention backends by name or "auto": `select_attention_backend` resolves a name once (a
`BackendChoice`), `create_attention_backend` builds the chosen one.

A backend module registers its class with `@register_attention_backend(name)`; `_MODULES` says
which module to import for a name, so nothing heavy (triton, flashinfer) loads until asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from lmnb.runtime.kernels.base import AttentionBackend, BackendChoice
from lmnb.runtime.memory import KVStorage, ReqToTokenPool
from lmnb.runtime.memory.kv_storage import Fp8Scales

_BACKENDS: dict[str, type[AttentionBackend]] = {}
# name -> module defining it; the GPU backends add their lines here when they land.
_MODULES: dict[str, str] = {
    "torch_native": "lmnb.runtime.kernels.torch_native",
    "flashinfer": "lmnb.runtime.kernels.flashinfer_backend",
    "triton": "lmnb.runtime.kernels.triton_backend",
}
# "auto" on CUDA tries these in order: (backend name, package it needs).
_AUTO_CUDA_ORDER: tuple[tuple[str, str], ...] = (("flashinfer", "flashinfer"), ("triton", "triton"))
_FALLBACK = "torch_native"


def register_attention_backend(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return register


def available_attention_backends() -> list[str]:
    """Names `attention_backend_class` accepts (besides "auto")."""
    return sorted(_MODULES)


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _MODULES:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(['auto', *available_attention_backends()])}")
    if name not in _BACKENDS:
        importlib.import_module(_MODULES[name])
    return _BACKENDS[name]


def select_attention_backend(name: str, device: torch.device, *,
                             dtype: torch.dtype | None = None,
                             head_dim: int | None = None) -> BackendChoice:
    """Resolve "auto" (FlashInfer, then Triton on CUDA, each if installed and able to serve
    `dtype`/`head_dim`; torch_native otherwise); check a name."""
    if name != "auto":
        attention_backend_class(name)  # raises ValueError for an unknown name
        return BackendChoice(name, "asked for by name")
    if device.type != "cuda":
        return BackendChoice(_FALLBACK, f"auto on {device.type}: GPU backends need CUDA")
    passed_over = []
    for candidate, package in _AUTO_CUDA_ORDER:
        if candidate not in _MODULES:
            passed_over.append(f"{candidate}: no such backend in this build")
        elif importlib.util.find_spec(package) is None:
            passed_over.append(f"{candidate}: package {package!r} is not installed")
        elif dtype is not None and head_dim is not None and (
                reason := attention_backend_class(candidate).unsupported(dtype=dtype,
                                                                         head_dim=head_dim)):
            passed_over.append(f"{candidate}: {reason}")
        elif dtype == torch.float8_e4m3fn and attention_backend_class(
                candidate).fp8_kv_scales == "tensor":
            passed_over.append(f"{candidate}: reads an FP8 KV pool with one scale per tensor "
                               "(ask for it by name); auto keeps per-token scales")
        else:
            return BackendChoice(candidate, "auto on cuda: first available")
    return BackendChoice(_FALLBACK, "auto on cuda: " + "; ".join(passed_over))


def fp8_kv_scales(choice: BackendChoice) -> Fp8Scales:
    """The scales an FP8 KV pool needs for the chosen backend."""
    return attention_backend_class(choice.name).fp8_kv_scales


def create_attention_backend(choice: BackendChoice, *, num_heads: int, num_kv_heads: int,
                             head_dim: int, req_to_token_pool: ReqToTokenPool,
                             kv_storage: KVStorage) -> AttentionBackend:
    """Instantiate the chosen backend (`select_attention_backend`) over the pools it will own."""
    backend = attention_backend_class(choice.name)(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        req_to_token_pool=req_to_token_pool, kv_storage=kv_storage)
    backend.choice = choice
    return backend
