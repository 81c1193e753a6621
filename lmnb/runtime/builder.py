"""Builds what a `Runtime` is made of, from its `EngineConfig`: the model folder and config, the
tokenizer and EOS ids, the tensor-parallel workers, the model runner (this rank's shard, KV pools,
decode graphs), the prefix cache and its pins, the output thread, the scheduler on its thread,
and the grammar factory. The engine only composes them (`engine.py`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmnb.multimodal.processor import MediaProcessor
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.distributed.group import TPError
from lmnb.runtime.distributed.step import Command
from lmnb.runtime.distributed.tp_worker import TPWorkers
from lmnb.runtime.fsm.factory import GrammarFactory
from lmnb.runtime.fsm.jump import JumpForward
from lmnb.runtime.hicache.factory import make_tiered_cache
from lmnb.runtime.hicache.identity import model_key, parameter_fingerprint
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers.fusion import fused_kernels_available, set_fused_kernels
from lmnb.runtime.output import OutputProcessor
from lmnb.runtime.output.stop import StopRules
from lmnb.runtime.pins import PrefixPins
from lmnb.runtime.policy import make_policy
from lmnb.runtime.prefix_cache import NoReuseCache, PrefixCache
from lmnb.runtime.radix.cache import RadixCache
from lmnb.runtime.scheduler import CacheManager, Scheduler, SchedulerConfig, SchedulerThread
from lmnb.runtime.speculative.factory import make_speculator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SHARED_PREFIX_MIN_TOKENS = 64  # a decode group's prefix worth reading once (one KV tile)


@dataclass
class ModelParts:
    """The model side: rank 0's runner and what it was built from."""

    device: torch.device
    model_dir: Path
    model_config: ModelConfig
    dtype: torch.dtype
    tokenizer: PreTrainedTokenizerBase  # the model's HF tokenizer
    eos_token_ids: set[int]
    media_processor: MediaProcessor | None  # None for a text model
    tp_workers: TPWorkers | None  # ranks 1..N-1 (tp_size > 1)
    runner: ModelRunner
    fused_kernels: bool


@dataclass
class ServingParts:
    """The request side, over a `ModelParts`' runner; the output and scheduler threads run."""

    allocator: KVAllocator
    cache: PrefixCache
    pins: PrefixPins  # touched on the scheduler thread only
    outputs: OutputProcessor
    scheduler: SchedulerThread
    grammars: GrammarFactory


def eos_token_ids(model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase,
                  model_dir: Path | None) -> set[int]:
    """The model's, the tokenizer's and `generation_config.json`'s EOS ids together."""
    ids: set[int] = set(model_config.eos_token_ids)

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    generation_config = model_dir / "generation_config.json" if model_dir else None
    if generation_config is not None and generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    return ids


def resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_model(config: EngineConfig) -> ModelParts:
    """Loads the model (and starts the tensor-parallel workers, which load their shards while
    this process loads the tokenizer); on failure the workers are stopped, and a dead worker's
    error is the one raised."""
    device = resolve_device(config.device)
    model_dir = loader.resolve_model_dir(config.model_path)
    model_config = loader.load_model_config(model_dir).quantized(config.quantization)
    dtype = loader.resolve_dtype(config.dtype, model_config.dtype, device)
    workers: TPWorkers | None = None
    if config.tp_size > 1:
        loader.check_tensor_parallel(model_config, config.tp_size)
        workers = TPWorkers(size=config.tp_size, device=device, model_dir=model_dir,
                            model_config=model_config, engine_config=config, dtype=dtype)
    try:
        tokenizer = loader.load_tokenizer(
            loader.resolve_tokenizer_dir(config.tokenizer_path or model_dir))
        eos = eos_token_ids(model_config, tokenizer, model_dir)
        media_processor = (MediaProcessor.from_model_dir(model_dir, model_config)
                           if model_config.is_multimodal else None)
        runner, fused = _build_runner(config, workers=workers, device=device,
                                      model_dir=model_dir, model_config=model_config,
                                      dtype=dtype, eos=eos)
    except BaseException as error:
        if workers is None:
            raise
        try:
            if not isinstance(error, TPError):
                workers.check()  # a dead worker is the clearer error
        except TPError as worker_error:
            raise worker_error from error
        finally:
            workers.close(graceful=False)
        raise
    return ModelParts(device=device, model_dir=model_dir, model_config=model_config,
                      dtype=dtype, tokenizer=tokenizer, eos_token_ids=eos,
                      media_processor=media_processor, tp_workers=workers, runner=runner,
                      fused_kernels=fused)


def _build_runner(config: EngineConfig, *, workers: TPWorkers | None, device: torch.device,
                  model_dir: Path, model_config: ModelConfig, dtype: torch.dtype,
                  eos: set[int]) -> tuple[ModelRunner, bool]:
    """Rank 0's shard, KV pools and decode graphs (the workers build theirs alongside); and
    whether fused kernels are on."""
    tp = workers.group if workers is not None else None
    model = loader.load_model(model_dir, model_config, dtype=dtype, device=device,
                              dummy=config.load_format == "dummy", tp=tp)
    fused = not config.disable_fused_kernels and fused_kernels_available(device)
    fused = fused and set_fused_kernels(model, fused) > 0  # the workers: alike
    if workers is not None:
        workers.connect()  # the workers have loaded their shards meanwhile
        workers.command(Command.RUNNER)
    runner = ModelRunner(model, model_config, config, device=device, dtype=dtype,
                         eos_token_ids=eos, tp=tp)
    if runner.graph_max_bs:
        if workers is not None:
            workers.command(Command.CAPTURE, runner.graph_max_bs)
        runner.capture_cuda_graphs(runner.graph_max_bs)
    return runner, fused


def _model_key(config: EngineConfig, model: ModelParts) -> str:
    """What the disk tier's pages are keyed by (`hicache/identity.py`)."""
    return model_key(
        model_dir=model.model_dir, model_config=model.model_config, dtype=model.dtype,
        load_format=config.load_format, tokenizer_vocab=model.tokenizer.get_vocab(),
        kv=model.runner.kv_storage,
        parameters=parameter_fingerprint(model.runner.model.named_parameters()))


def build_serving(config: EngineConfig, model: ModelParts) -> ServingParts:
    """The prefix cache, the output thread and the scheduler thread (both started)."""
    runner, device = model.runner, model.device
    scheduler_config = SchedulerConfig(
        chunked_prefill_size=config.prefill_chunk_size(device.type),
        check_integrity_each_step=config.check_integrity_each_step,
        shared_prefix_min_tokens=(
            0 if config.disable_shared_prefix_decode
            or not runner.attn_backend.supports_shared_prefixes
            else SHARED_PREFIX_MIN_TOKENS),
        overlap_schedule=(device.type == "cuda" if config.disable_overlap_schedule is None
                          else not config.disable_overlap_schedule),
        exact_length_admission=os.environ.get("LMNB_DISABLE_EXACT_ADMISSION") != "1",
        weight_version=config.weight_version,
    ).conservative(config.schedule_conservativeness)
    allocator = KVAllocator(runner.max_total_tokens, device)
    cache: PrefixCache = (
        NoReuseCache(allocator) if config.disable_radix_cache
        else make_tiered_cache(config, allocator, runner.kv_storage,
                               model_key=lambda: _model_key(config, model))
        if config.enable_hierarchical_cache else RadixCache(allocator))
    speculative = config.speculative()
    speculator = (make_speculator(speculative, engine_config=config, target=runner,
                                  eos_token_ids=model.eos_token_ids)
                  if speculative is not None else None)
    outputs = OutputProcessor()
    outputs.start()
    pins = PrefixPins(cache)
    scheduler = Scheduler(
        runner=runner, cache=CacheManager(cache, allocator, runner.req_to_token_pool, pins),
        policy=make_policy(config.schedule_policy), config=scheduler_config,
        stop_rules=StopRules(model.eos_token_ids), sink=outputs, tokenizer=model.tokenizer,
        jump_forward=None if config.disable_jump_forward else JumpForward(model.tokenizer),
        vocab_size=model.model_config.vocab_size, speculator=speculator,
        verifier=runner if speculator is not None else None)
    thread = SchedulerThread(scheduler)
    grammars = GrammarFactory(model.tokenizer, vocab_size=model.model_config.vocab_size,
                              eos_token_ids=model.eos_token_ids, backend=config.grammar_backend)
    return ServingParts(allocator=allocator, cache=cache, pins=pins,
                        outputs=outputs, scheduler=thread, grammars=grammars)
