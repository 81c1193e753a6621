"""The model identity that names the disk tier's pages: KV computed by one runtime is reused only
by a runtime whose KV would be the same bits (same weights, config, dtype, tokenizer, layout, and
for a multimodal model the media preprocessing: a span's pad ids hash the raw pixels, its KV
depends on the preprocessed ones)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from lmnb.runtime.memory import KVStorage

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_PREPROCESSING_FILES = ("preprocessor_config.json", "processor_config.json",
                        "video_preprocessor_config.json")


def _weight_files(model_dir: Path | None) -> list[tuple[str, int]]:
    if model_dir is None:
        return []
    if model_dir.is_file():
        return [(model_dir.name, model_dir.stat().st_size)]
    return sorted((p.name, p.stat().st_size) for p in model_dir.iterdir()
                  if p.name.endswith(_WEIGHT_SUFFIXES))


def _preprocessing(model_dir: Path | None) -> dict[str, str]:
    """sha256 of each media preprocessing config the folder has."""
    if model_dir is None or not model_dir.is_dir():
        return {}
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
            for name in _PREPROCESSING_FILES if (model_dir / name).is_file()}


def parameter_fingerprint(named: Iterable[tuple[str, torch.Tensor]], sample: int = 32) -> str:
    """Names, shapes, dtypes and the first `sample` values of every parameter (one transfer):
    tells apart checkpoints of equal sizes, e.g. random weights of different seeds."""
    names, heads = [], []
    for name, param in named:
        names.append(f"{name}:{tuple(param.shape)}:{param.dtype}")
        heads.append(param.detach().flatten()[:sample].float())
    digest = hashlib.sha256("\n".join(names).encode())
    if heads:
        digest.update(torch.cat(heads).cpu().numpy().tobytes())
    return digest.hexdigest()


def model_key(*, model_dir: Path | None, model_config: object, dtype: torch.dtype,
              load_format: str, tokenizer_vocab: dict[str, int], kv: KVStorage,
              parameters: str) -> str:
    """A hex digest of everything the KV depends on."""
    parts = {
        "version": FORMAT_VERSION,
        "weights": _weight_files(model_dir),
        "preprocessing": _preprocessing(model_dir),
        "config": repr(model_config),
        "dtype": str(dtype),
        "load_format": load_format,
        "tokenizer": hashlib.sha256(json.dumps(sorted(tokenizer_vocab.items())).encode())
        .hexdigest(),
        "kv": [kv.num_layers, kv.kv_heads, kv.head_dim, str(kv.dtype)],
        "parameters": parameters,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
