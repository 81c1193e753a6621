"""Typed configuration: `EngineConfig` (every `Runtime(**options)` key, SGLang's option names) and
`ModelConfig` (the architecture, normalised from an HF config, LLaVA's `text_config` included).

Nothing below the engine reads a raw HF config: models, the loader's model building and the model
runner take a `ModelConfig`. No torch at module level: both are plain, picklable data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lmnb.runtime.generation_defaults import SAMPLING_DEFAULTS
from lmnb.runtime.quantization import (
    QUANTIZATION_METHODS,
    Fp8Config,
    UnsupportedQuantizationError,
    checkpoint_quantization,
    kv_cache_dtype_name,
    resolve_quantization,
)
from lmnb.runtime.speculative.config import SpeculativeConfig

# Accepted dtype spellings -> canonical names (the attribute names in `torch`).
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
LOAD_FORMATS = ("auto", "dummy")
GRAMMAR_BACKENDS = ("lmnb", "xgrammar")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_STORAGE_BACKENDS = ("file",)
_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")


def canonical_dtype(dtype: Any) -> str:
    """'float32' | 'float16' | 'bfloat16' for a name or a floating torch.dtype; ValueError else."""
    if not isinstance(dtype, str) and type(dtype).__module__ == "torch":  # a torch.dtype
        if not getattr(dtype, "is_floating_point", False):
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        dtype = str(dtype)
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def _check_int(name: str, value: Any, *, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every option of `Runtime(model_path, **options)`, validated on construction.

    Names and meanings follow SGLang's server arguments. Sizes left as None are chosen from the
    device and the model when the runtime starts. `dtype` and `device` are stored as strings
    ('auto' or a canonical name) so that the config stays plain data.
    """

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer_path: str | None = None  # None: the model's own tokenizer
    load_format: str = "auto"  # 'auto' (checkpoint files) | 'dummy' (seeded random weights)
    dtype: str = "auto"  # 'auto': float32 on CPU, the checkpoint's dtype on GPUs (fp32 -> bf16)
    device: str = "auto"  # 'auto': cuda when available, else cpu
    context_length: int | None = None  # capped by the model's positions and the KV pool
    # a prompt plus max_new_tokens over the context length: cut max_new_tokens to fit (SGLang's
    # option) instead of refusing the request (InvalidRequestError; a 400 from the servers)
    allow_auto_truncate: bool = False
    # where OpenAI requests' omitted temperature, top_p, top_k, min_p and repetition_penalty come
    # from (SGLang's option): 'model' (generation_config.json's values, else OpenAI's) | 'openai'
    sampling_defaults: str = "model"
    max_total_tokens: int | None = None  # KV pool size in tokens
    mem_fraction_static: float | None = None  # of device memory for weights + KV pool
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # prompt tokens per prefill pass
    schedule_policy: str = "lpm"
    # scales the KV reserved for running requests' future tokens when admitting (SGLang's
    # option): lower admits more requests at once and retracts when the pool runs out
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    disable_jump_forward: bool = False
    grammar_backend: str = "lmnb"  # regex/JSON schema: 'lmnb' (compressed FSM) | 'xgrammar'
    attention_backend: str | None = None  # None: the default backend for the device
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # largest decode batch captured in a CUDA graph
    disable_overlap_schedule: bool | None = None  # None: overlap on CUDA only; False forces it on
    disable_fused_kernels: bool = False  # torch ops instead of the fused Triton kernels (CUDA)
    # decode reads a prefix shared by a group of requests once per group (Triton backend)
    disable_shared_prefix_decode: bool = False
    random_seed: int | None = None
    weight_version: str = "default"  # the weights' label, in `/model_info` and each meta_info
    tp_size: int = 1  # tensor-parallel ranks: this process and tp_size - 1 spawned workers
    dp_size: int = 1  # > 1: `Runtime` builds a DataParallelRuntime (replicas + router)
    check_integrity_each_step: bool = False  # KV slot accounting after every step (tests)
    # Speculative decoding (SGLang's names; see speculative/config.py): None | 'NGRAM' |
    # 'STANDALONE' (a draft model)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None  # verify positions: last token + drafts
    speculative_draft_model_path: str | None = None  # STANDALONE's draft model
    speculative_num_steps: int | None = None  # STANDALONE: draft passes per verify pass
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"  # 'BFS' (most recent) | 'PROB' (most frequent)
    speculative_ngram_max_trie_depth: int = 18  # longest context suffix matched
    speculative_ngram_capacity: int = 10_000_000  # tokens of recent requests kept
    speculative_max_batch_size: int = 8  # lmnb: larger decode batches do not speculate
    speculative_min_accept_rate: float = 0.15  # lmnb: below it a request pauses speculation
    speculative_draft_policy: str = "adaptive"  # lmnb: 'adaptive' (cost model) | 'always'
    speculative_verify_mode: str = "auto"  # lmnb: 'auto' | 'extend' | 'decode' (graph-able)
    # FP8 (see runtime/quantization.py): None | 'fp8' | 'compressed-tensors'
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # 'auto' (the model's) | 'fp8_e4m3' | 'bf16' | 'bfloat16'
    # Hierarchical cache (runtime/hicache/): evicted KV kept in host memory, optionally on disk.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pool tokens per device pool token
    hicache_size: int = 0  # host pool in GB; overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"  # 'write_through' (on insert) | 'write_back'
    hicache_storage_backend: str | None = None  # 'file': KV pages on disk, across restarts
    hicache_storage_dir: str | None = None  # None: ~/.cache/lmnb/hicache
    hicache_storage_size: float = 16.0  # GB the storage directory may hold (oldest pages go)

    def __post_init__(self) -> None:
        for path_field in ("model_path", "tokenizer_path"):
            value = getattr(self, path_field)
            if value is not None:
                if not isinstance(value, str | os.PathLike):
                    raise ValueError(f"{path_field} must be a path or None, got {value!r}")
                object.__setattr__(self, path_field, os.fspath(value))
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of: "
                             f"{', '.join(LOAD_FORMATS)}")
        if not (isinstance(self.dtype, str) and self.dtype.lower() == "auto"):
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        else:
            object.__setattr__(self, "dtype", "auto")
        device = str(self.device) if type(self.device).__module__ == "torch" else self.device
        if not isinstance(device, str) or not _DEVICE.fullmatch(device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        object.__setattr__(self, "device", device)
        _check_int("context_length", self.context_length, minimum=2)
        _check_int("max_total_tokens", self.max_total_tokens, minimum=2)
        _check_int("max_running_requests", self.max_running_requests, minimum=1)
        _check_int("chunked_prefill_size", self.chunked_prefill_size, minimum=1)
        _check_int("cuda_graph_max_bs", self.cuda_graph_max_bs, minimum=1)
        _check_int("random_seed", self.random_seed, minimum=0)
        _check_int("tp_size", self.tp_size, minimum=1, optional=False)
        _check_int("dp_size", self.dp_size, minimum=1, optional=False)
        conservativeness = self.schedule_conservativeness
        if (isinstance(conservativeness, bool) or not isinstance(conservativeness, int | float)
                or not conservativeness >= 0.0):
            raise ValueError("schedule_conservativeness must be a number >= 0, got "
                             f"{conservativeness!r}")
        fraction = self.mem_fraction_static
        if fraction is not None and (isinstance(fraction, bool)
                                     or not isinstance(fraction, int | float)
                                     or not 0.0 < fraction <= 1.0):
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {fraction!r}")
        for flag in ("disable_radix_cache", "disable_jump_forward", "disable_cuda_graph",
                     "disable_overlap_schedule", "disable_fused_kernels",
                     "disable_shared_prefix_decode", "allow_auto_truncate",
                     "check_integrity_each_step"):
            if flag == "disable_overlap_schedule" and self.disable_overlap_schedule is None:
                continue
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.attention_backend is not None and (not isinstance(self.attention_backend, str)
                                                   or not self.attention_backend):
            raise ValueError(f"attention_backend must be a backend name or None, "
                             f"got {self.attention_backend!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"unknown sampling_defaults {self.sampling_defaults!r}; choose one "
                             f"of: {', '.join(SAMPLING_DEFAULTS)}")
        self._check_policy()
        self._check_grammar_backend()
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise UnsupportedQuantizationError(
                f"unknown quantization {self.quantization!r}; choose one of: "
                f"{', '.join(QUANTIZATION_METHODS)}")
        kv_cache_dtype_name(self.kv_cache_dtype)
        speculative = self.speculative()
        if speculative is not None and self.tp_size > 1:
            raise ValueError("speculative_algorithm is not supported with tp_size > 1")
        self._check_hicache()

    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative-decoding options; None without `speculative_algorithm`."""
        return SpeculativeConfig.from_options(
            algorithm=self.speculative_algorithm,
            num_draft_tokens=self.speculative_num_draft_tokens,
            num_steps=self.speculative_num_steps,
            draft_model_path=(os.fspath(self.speculative_draft_model_path)
                              if isinstance(self.speculative_draft_model_path, os.PathLike)
                              else self.speculative_draft_model_path),
            min_bfs_breadth=self.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=self.speculative_ngram_max_bfs_breadth,
            match_type=self.speculative_ngram_match_type,
            max_trie_depth=self.speculative_ngram_max_trie_depth,
            capacity=self.speculative_ngram_capacity,
            max_batch_size=self.speculative_max_batch_size,
            min_accept_rate=self.speculative_min_accept_rate,
            draft_policy=self.speculative_draft_policy,
            verify_mode=self.speculative_verify_mode)


    def _check_hicache(self) -> None:
        if not isinstance(self.enable_hierarchical_cache, bool):
            raise ValueError(f"enable_hierarchical_cache must be True or False, "
                             f"got {self.enable_hierarchical_cache!r}")
        _check_int("hicache_size", self.hicache_size, minimum=0, optional=False)
        for name in ("hicache_ratio", "hicache_storage_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"unknown hicache_write_policy {self.hicache_write_policy!r}; "
                             f"choose one of: {', '.join(HICACHE_WRITE_POLICIES)}")
        backend = self.hicache_storage_backend
        if backend is not None and backend not in HICACHE_STORAGE_BACKENDS:
            raise ValueError(f"unknown hicache_storage_backend {backend!r}; choose one of: "
                             f"{', '.join(HICACHE_STORAGE_BACKENDS)} (or None)")
        if self.hicache_storage_dir is not None:
            if not isinstance(self.hicache_storage_dir, str | os.PathLike):
                raise ValueError(f"hicache_storage_dir must be a path or None, "
                                 f"got {self.hicache_storage_dir!r}")
            object.__setattr__(self, "hicache_storage_dir", os.fspath(self.hicache_storage_dir))
        if not self.enable_hierarchical_cache:
            if backend is not None:
                raise ValueError("hicache_storage_backend needs enable_hierarchical_cache=True")
            return
        if self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache and disable_radix_cache are mutually "
                             "exclusive")
        if self.tp_size > 1:
            raise ValueError("enable_hierarchical_cache does not support tp_size > 1 yet")
        if kv_cache_dtype_name(self.kv_cache_dtype) == "float8_e4m3fn":
            raise ValueError("enable_hierarchical_cache does not support kv_cache_dtype="
                             "'fp8_e4m3' yet (the host tier does not carry the FP8 pool's "
                             "per-token scales)")

    def _check_grammar_backend(self) -> None:
        """'lmnb' or 'xgrammar' (EBNF grammars always go through xgrammar); 'xgrammar' needs the
        package (looked up, not imported)."""
        from importlib.util import find_spec

        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar_backend {self.grammar_backend!r}; choose one of: "
                             f"{', '.join(GRAMMAR_BACKENDS)}")
        if self.grammar_backend == "xgrammar" and find_spec("xgrammar") is None:
            raise ValueError("grammar_backend='xgrammar' needs the xgrammar package "
                             "(pip install xgrammar)")

    def _check_policy(self) -> None:
        if not isinstance(self.schedule_policy, str):
            raise ValueError(f"schedule_policy must be a name, got {self.schedule_policy!r}")
        from lmnb.runtime.policy import make_policy  # its names come from its registry

        make_policy(self.schedule_policy)

    def prefill_chunk_size(self, device_type: str) -> int:
        """Most prompt tokens one EXTEND pass holds: `chunked_prefill_size`, else 8192 on CUDA
        and 2048 on CPU."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 8192 if device_type == "cuda" else 2048

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """`EngineConfig(**options)`, with a TypeError naming unknown options and the known ones."""
        known = cls.option_names()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown Runtime option(s): {', '.join(unknown)}; "
                            f"known options: {', '.join(known)}")
        return cls(**options)


# Keys under which HF configs of other families store the trained context length.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                 "max_seq_len")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _sliding_window(text: Mapping[str, Any]) -> int | None:
    """The decoder's attention window where any layer has one (Mistral's `sliding_window`;
    Qwen2's with `use_sliding_window`, for the `layer_types` marked sliding), else None. Llama
    has none, whatever its config.json says."""
    if text.get("model_type") == "llama":
        return None
    window = text.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return None
    if text.get("use_sliding_window") is False:
        return None
    return window


def _rope(text: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from transformers 4 (`rope_theta` + `rope_scaling`) or 5
    (`rope_parameters`); the scaling dict has `rope_type` and no theta."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or text.get("rope_theta") or 10000.0
    rope_type = params.pop("type", None) or params.pop("rope_type", None) or "default"
    return float(theta), (None if rope_type == "default" else {"rope_type": rope_type, **params})


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A ViT vision tower (CLIP's), normalised from an HF `vision_config`."""

    model_type: str  # 'clip_vision_model'
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tower's square input (one tile), in pixels
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size",
                     "patch_size", "num_channels"):
            _check_int(name, getattr(self, name), minimum=1, optional=False)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size ({self.image_size}) must be a multiple of "
                             f"patch_size ({self.patch_size})")

    @property
    def grid(self) -> int:
        """Patches per side of one tile."""
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision: Mapping[str, Any]) -> VisionConfig:
        model_type = vision.get("model_type") or ""
        if model_type not in _VISION_MODEL_TYPES:
            raise ValueError(f"vision tower {model_type!r} is not supported "
                             f"({', '.join(_VISION_MODEL_TYPES)})")
        return cls(model_type=model_type, hidden_size=vision.get("hidden_size"),
                   intermediate_size=vision.get("intermediate_size"),
                   num_layers=vision.get("num_hidden_layers"),
                   num_heads=vision.get("num_attention_heads"),
                   image_size=vision.get("image_size"),
                   patch_size=vision.get("patch_size"),
                   num_channels=vision.get("num_channels") or 3,
                   hidden_act=vision.get("hidden_act") or "quick_gelu",
                   layer_norm_eps=float(vision.get("layer_norm_eps") or 1e-5))


_VISION_MODEL_TYPES = ("clip_vision_model",)
_SELECT_STRATEGIES = ("default", "full")
_POOL_MODES = ("average", "max", "conv")


@dataclass(frozen=True, slots=True)
class MultimodalConfig:
    """What a LLaVA-family model does with media besides its decoder, from the HF config.

    `feature_layers`: the tower's hidden states (HF `vision_feature_layer`, an int or a list,
    as a tuple; index 0 is the embeddings, -1 the last layer's output) concatenated per patch.
    `select_strategy`: 'default' drops the CLS position, 'full' keeps it.
    `image_grid_pinpoints`: anyres resolutions ((height, width), ...) of LLaVA-NeXT; None for
    LLaVA-1.5 (one tile per image). `spatial_pool_mode`/`_stride`: LLaVA-NeXT-Video's pooling of
    each frame's patch grid (None: no video support). Token counts: `lmnb.multimodal.anyres`.
    """

    vision: VisionConfig
    image_token_id: int | None
    video_token_id: int | None = None
    feature_layers: tuple[int, ...] = (-2,)
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True
    image_grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    spatial_pool_mode: str | None = None
    spatial_pool_stride: int = 2

    def __post_init__(self) -> None:
        if self.select_strategy not in _SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not "
                             f"supported ({', '.join(_SELECT_STRATEGIES)})")
        if not self.feature_layers:
            raise ValueError("vision_feature_layer names no layer")
        for layer in self.feature_layers:
            if not -(self.vision.num_layers + 1) <= layer <= self.vision.num_layers:
                raise ValueError(f"vision_feature_layer {layer} is out of range for a tower of "
                                 f"{self.vision.num_layers} layers")
        if self.spatial_pool_mode is not None and self.spatial_pool_mode not in _POOL_MODES:
            raise ValueError(f"spatial_pool_mode {self.spatial_pool_mode!r} is not supported "
                             f"({', '.join(_POOL_MODES)})")
        _check_int("spatial_pool_stride", self.spatial_pool_stride, minimum=1, optional=False)

    @property
    def anyres(self) -> bool:
        return self.image_grid_pinpoints is not None

    @property
    def supports_video(self) -> bool:
        return self.spatial_pool_mode is not None and self.video_token_id is not None

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any],
                image_token_id: int | None) -> MultimodalConfig:
        """From an HF config's values (see `ModelConfig.from_hf`)."""

        def read(name: str, default: Any) -> Any:
            value = hf_config.get(name)
            return default if value is None else value

        model_type = read("model_type", "")
        layers = read("vision_feature_layer", -2)
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        pinpoints = hf_config.get("image_grid_pinpoints")
        if model_type == "llava":
            pinpoints = None  # LLaVA-1.5 ignores a pinpoints entry
        video_token = hf_config.get("video_token_id")
        if video_token is None:
            video_token = hf_config.get("video_token_index")
        pool_mode = hf_config.get("spatial_pool_mode") if video_token is not None else None
        return cls(
            vision=VisionConfig.from_hf(hf_config.get("vision_config")),
            image_token_id=image_token_id,
            video_token_id=video_token,
            feature_layers=layers,
            select_strategy=read("vision_feature_select_strategy", "default"),
            projector_act=read("projector_hidden_act", "gelu"),
            projector_bias=bool(read("multimodal_projector_bias", True)),
            image_grid_pinpoints=(tuple((int(h), int(w)) for h, w in pinpoints)
                                  if pinpoints else None),
            spatial_pool_mode=pool_mode,
            spatial_pool_stride=int(hf_config.get("spatial_pool_stride") or 2),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's architecture, whatever the HF config's layout; built by `from_hf`."""

    architecture: str | None  # HF `architectures[0]` of the top-level config
    model_type: str  # of the top-level config ('llava' for LLaVA, whose decoder is 'llama')
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {'rope_type': 'llama3', 'factor': ...} or None
    hidden_act: str = "silu"
    qkv_bias: bool = False  # Qwen2 always; Llama with attention_bias
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # the checkpoint's dtype ('bfloat16', ...), None when unknown
    initializer_range: float = 0.02
    image_token_id: int | None = None  # multimodal configs only
    text_model_type: str = ""  # the decoder's model_type ('' = model_type)
    video_token_id: int | None = None  # LLaVA-NeXT-Video
    multimodal: MultimodalConfig | None = None  # vision tower, projector, anyres, pooling
    quantization: Fp8Config | None = None  # FP8 decoder linears (the checkpoint's, or asked for)
    sliding_window: int | None = None  # some layers attend to the last this many tokens only
    # the sampling parameters generation_config.json recommends (generation_defaults.py); not
    # in the repr, which keys the disk tier's KV pages (`hicache/identity.py`): KV does not
    # depend on them
    generation_defaults: dict[str, float | int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            _check_int(name, getattr(self, name), minimum=1, optional=False)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if not self.text_model_type:
            object.__setattr__(self, "text_model_type", self.model_type)

    @property
    def context_length(self) -> int:
        """The longest sequence served: the model's, or its sliding window where it has one
        (lmnb's attention is full; within the window the two are the same)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def is_multimodal(self) -> bool:
        return self.text_model_type != self.model_type

    def quantized(self, option: str | None) -> ModelConfig:
        """This config with the quantization `Runtime(quantization=option)` gives it (see
        `quantization.resolve_quantization`)."""
        return replace(self, quantization=resolve_quantization(option, self.quantization))

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Normalise the values an HF `PretrainedConfig` holds, sub-configs as mappings: its
        `to_dict()`, or what `models.hf_config.read_config` makes of a config.json; a nested
        `text_config` (LLaVA and its relatives) supplies the decoder's fields."""
        text = hf_config.get("text_config") or hf_config

        def read(name: str, default: Any = None) -> Any:
            value = text.get(name)
            return default if value is None else value

        def top_or_text(name: str) -> Any:
            value = hf_config.get(name)
            return read(name) if value is None else value

        name = f"config of model_type {hf_config.get('model_type')!r}"
        num_heads = read("num_attention_heads")
        hidden_size = read("hidden_size")
        if num_heads is None or hidden_size is None:
            raise ValueError(f"{name} has no num_attention_heads/hidden_size: not a decoder "
                             "config this runtime can serve")
        context = next((text.get(k) for k in _CONTEXT_KEYS
                        if isinstance(text.get(k), int)), None)
        if context is None:
            raise ValueError(f"{name} states no context length "
                             f"({', '.join(_CONTEXT_KEYS)})")
        theta, scaling = _rope(text)
        text_model_type = read("model_type", "")
        attention_bias = bool(read("attention_bias", False))
        is_qwen2 = text_model_type == "qwen2"
        checkpoint_dtype = top_or_text("dtype") or top_or_text("torch_dtype")
        try:
            checkpoint_dtype = canonical_dtype(checkpoint_dtype) if checkpoint_dtype else None
        except ValueError:
            checkpoint_dtype = None
        architectures = hf_config.get("architectures") or []
        image_token = hf_config.get("image_token_id")
        if image_token is None:
            image_token = hf_config.get("image_token_index")
        multimodal = (MultimodalConfig.from_hf(hf_config, image_token)
                      if hf_config.get("vision_config") is not None else None)
        return cls(
            architecture=architectures[0] if architectures else None,
            model_type=hf_config.get("model_type") or text_model_type,
            text_model_type=text_model_type,
            num_layers=read("num_hidden_layers"),
            hidden_size=hidden_size,
            intermediate_size=read("intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=read("num_key_value_heads", num_heads),
            head_dim=read("head_dim") or hidden_size // num_heads,
            vocab_size=read("vocab_size"),
            max_position_embeddings=context,
            rms_norm_eps=float(read("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            hidden_act=read("hidden_act", "silu"),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(read("mlp_bias", False)),
            tie_word_embeddings=bool(read("tie_word_embeddings", False)),
            bos_token_id=top_or_text("bos_token_id"),
            eos_token_ids=_eos_ids(top_or_text("eos_token_id")),
            dtype=checkpoint_dtype,
            initializer_range=float(read("initializer_range", 0.02)),
            image_token_id=image_token,
            video_token_id=multimodal.video_token_id if multimodal else None,
            multimodal=multimodal,
            quantization=checkpoint_quantization(hf_config.get("quantization_config")),
            sliding_window=_sliding_window(text),
        )
