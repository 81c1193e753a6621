"""`make_speculator`: the runtime's speculator for its `SpeculativeConfig` (NGRAM: an n-gram
index; STANDALONE: a draft model loaded beside the target, with its own runner and KV pool)."""

from __future__ import annotations

import dataclasses

import torch

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers.fusion import fused_kernels_available, set_fused_kernels
from lmnb.runtime.speculative.config import SpeculativeConfig
from lmnb.runtime.speculative.draft_model import DraftModelSource
from lmnb.runtime.speculative.speculator import DraftSource, NgramSource, Speculator


def make_speculator(spec: SpeculativeConfig, *, engine_config: EngineConfig,
                    target: ModelRunner, eos_token_ids: set[int]) -> Speculator:
    source: DraftSource
    if spec.algorithm == "STANDALONE":
        source = _draft_model(spec, engine_config=engine_config, target=target,
                              eos_token_ids=eos_token_ids)
    else:
        source = NgramSource(spec)
    return Speculator(spec, source, eos_token_ids)


def _draft_model(spec: SpeculativeConfig, *, engine_config: EngineConfig, target: ModelRunner,
                 eos_token_ids: set[int]) -> DraftModelSource:
    """The draft model on the target's device and dtype, with the target's request rows and KV
    slots for the requests that may speculate at once (`max_batch_size` + 1 whole contexts, at
    most the target's pool); loaded after the target: on a GPU, leave it room with
    `mem_fraction_static`."""
    assert spec.draft_model_path is not None
    model_dir = loader.resolve_model_dir(spec.draft_model_path)
    model_config = loader.load_model_config(model_dir)
    if model_config.vocab_size > target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({model_config.vocab_size}) is larger "
                         f"than the target's ({target.vocab_size}): they must share a tokenizer")
    device, dtype = target.device, target.dtype
    model = loader.load_model(model_dir, model_config, dtype=dtype, device=device,
                              dummy=engine_config.load_format == "dummy")
    if not engine_config.disable_fused_kernels and fused_kernels_available(device):
        set_fused_kernels(model, True)
    config = dataclasses.replace(
        engine_config, model_path=str(model_dir),
        max_total_tokens=min(target.max_total_tokens,
                             (spec.max_batch_size + 1) * target.context_len),
        max_running_requests=target.max_running_requests, context_length=target.context_len,
        speculative_algorithm=None, speculative_draft_model_path=None,
        speculative_num_steps=None, speculative_num_draft_tokens=None, tp_size=1, dp_size=1,
        quantization=None)  # the draft's own checkpoint, unquantized
    runner = ModelRunner(model, model_config, config, device=device, dtype=dtype,
                         eos_token_ids=eos_token_ids,  # catch-up passes as rows (graphs)
                         row_pass_rows=spec.max_batch_size * spec.num_draft_tokens)
    if runner.graph_max_bs:
        runner.capture_cuda_graphs(runner.graph_max_bs)
    return DraftModelSource(runner, KVAllocator(runner.max_total_tokens, torch.device(device)))
