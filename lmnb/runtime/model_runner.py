"""Owns the model, the KV pools and the attention backend; runs one `Batch` and samples from it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmnb.multimodal.embedding_cache import EmbeddingCache
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.graph_runner import DecodeGraphRunner
from lmnb.runtime.kernels.registry import create_attention_backend
from lmnb.runtime.memory import KVStorage, ReqToTokenPool
from lmnb.runtime.sampling import Sampler, SamplingBatchInfo, all_allowed, stack_bitmasks
from lmnb.runtime.sampling.row import SamplingRow

TopLogprobs = list[tuple[float, int]]
CPU_KV_MEMORY_FRACTION = 0.15  # of the host's available memory, when no size is given on CPU
CPU_MAX_DEFAULT_TOKENS = 65536


@dataclass
class StepOutput:
    """Per request of a batch: the sampled token (None when the request did not sample)."""

    next_token_ids: list[int | None]
    next_token_logprobs: list[float | None]
    next_top_logprobs: list[TopLogprobs | None]
    # prompt logprobs computed in this pass (None for a media pad id)
    input_logprobs: list[list[tuple[float | None, int]]]
    input_top_logprobs: list[list[TopLogprobs | None]]


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


class ModelRunner:
    """Sizes and owns the KV pools from the engine and model configs, and runs the model.

    `device` and `dtype` are the resolved ones (the engine config may say 'auto')."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig,
                 engine_config: EngineConfig, *, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: set[int]) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.vocab_size = model_config.vocab_size
        num_layers, num_kv_heads = model_config.num_layers, model_config.num_kv_heads
        head_dim = model_config.head_dim
        per_token = KVStorage.bytes_per_token(
            num_layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        self.max_total_tokens = (engine_config.max_total_tokens
                                 or self._kv_budget(per_token, engine_config.mem_fraction_static))
        model_context = model_config.context_length
        self.context_len = min(engine_config.context_length or model_context, model_context,
                               self.max_total_tokens)
        self.max_running_requests = engine_config.max_running_requests or min(
            256, max(self.max_total_tokens // 2, 1))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 1,
                                                device)
        self.kv_storage = KVStorage(
            self.max_total_tokens, num_layers=num_layers, kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=dtype, device=device)
        self.attn_backend = create_attention_backend(
            engine_config.attention_backend or "auto", device=device,
            num_heads=model_config.num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            req_to_token_pool=self.req_to_token_pool, kv_storage=self.kv_storage)
        self.sampler = Sampler(self.vocab_size, eos_token_ids)
        self._batch_info: SamplingBatchInfo | None = None
        self.graph_runner: DecodeGraphRunner | None = None
        self.media_cache = EmbeddingCache()
        self._last_sampled: torch.Tensor | None = None  # [bs] ids the last launch sampled

    def _kv_budget(self, per_token: int, mem_fraction_static: float | None) -> int:
        """KV pool tokens that fit: on CUDA, `mem_fraction_static` (default 0.80) of the device
        holds weights + KV; on CPU, that fraction (default 15%, at most 65536 tokens unless the
        fraction is given) of the host's available memory."""
        available = _available_memory(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # The rest is for activations (torch-native decode gathers the padded K/V of the
            # whole batch per layer, so it needs room).
            fraction = 0.80 if mem_fraction_static is None else mem_fraction_static
            budget = total * fraction - (total - available)
        else:
            fraction = (CPU_KV_MEMORY_FRACTION if mem_fraction_static is None
                        else mem_fraction_static)
            budget = available * fraction
        tokens = int(budget // per_token)
        if self.device.type == "cpu" and mem_fraction_static is None:
            tokens = min(tokens, CPU_MAX_DEFAULT_TOKENS)
        if tokens < 2:
            raise ValueError(f"no memory left for the KV cache (mem_fraction_static={fraction})")
        return tokens

    def capture_cuda_graphs(self, max_bs: int) -> None:
        """Captures decode graphs for batches of up to `max_bs` requests (CUDA only)."""
        self.graph_runner = DecodeGraphRunner(self.model, self.attn_backend,
                                              max_bs=min(max_bs, self.max_running_requests),
                                              device=self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def media_counters(self) -> dict[str, int]:
        """Vision-tower runs (one per new image/video embedded) and the embeddings cache."""
        cache = self.media_cache
        return {"vision_tower_runs": cache.runs, "media_embedding_hits": cache.hits,
                "media_embedding_cache_bytes": cache.bytes}

    def close(self) -> None:
        self.media_cache.clear()
        self.graph_runner = None
        self.kv_storage.release()
        self.model = None

    def run(self, batch: Batch, rows: Sequence[SamplingRow]) -> StepOutput:
        """Forward `batch`; sample one token for each request with `batch.samples[i]`, whose
        sampling state is `rows` (in batch order)."""
        return self.launch(batch, rows).result()

    @torch.inference_mode()
    def launch(self, batch: Batch, rows: Sequence[SamplingRow]) -> PendingStep:
        """Enqueues the forward pass and the sampling on the device and starts the copies of
        their results to the host; `result()` waits for them. With `batch.follows_previous`
        the input ids are the tokens the previous launch sampled (still on the device)."""
        input_ids: list[int] | torch.Tensor = batch.input_ids
        if batch.follows_previous:
            if self._last_sampled is None or self._last_sampled.numel() != batch.size:
                raise RuntimeError("follows_previous without a matching previous decode pass")
            input_ids = self._last_sampled
        forward_batch = self.forward_batch(batch, input_ids)
        hidden = graph_logits = None
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            graph_logits = self.graph_runner.replay(forward_batch)  # decode: every row samples
        else:
            self.attn_backend.init_forward_metadata(forward_batch)
            if batch.mode is ForwardMode.EXTEND and batch.has_media:
                embeds = self._input_embeds(batch, forward_batch.input_ids)
                hidden = self.model(forward_batch.input_ids.clamp(max=self.vocab_size - 1),
                                    forward_batch.positions, forward_batch, input_embeds=embeds)
            else:
                hidden = self.model(forward_batch.input_ids, forward_batch.positions,
                                    forward_batch)
        sample_rows: list[int] = []
        last_token_rows: list[int] = []
        end = 0
        for i, extend_len in enumerate(batch.extend_lens):
            end += extend_len
            if batch.samples[i]:
                sample_rows.append(i)
                last_token_rows.append(end - 1)
        sampled = None
        self._last_sampled = None
        if sample_rows:
            logits = (graph_logits if graph_logits is not None
                      else self.model.compute_logits(hidden[last_token_rows]))
            rows = list(rows)
            info = self._sampling_info(rows)
            sampled = self.sampler(logits, info, self._grammar_mask(rows, info))
            info.advance(sampled.next_token_ids)
            if len(sample_rows) == batch.size:
                self._last_sampled = sampled.next_token_ids
        return PendingStep(self, batch, hidden, sample_rows, sampled)

    def _sampling_info(self, rows: list) -> SamplingBatchInfo:
        """The cached SamplingBatchInfo while the sampled rows stay the same (decode steps)."""
        info = self._batch_info
        if info is None or not info.matches(rows):
            info = self._batch_info = self.sampler.batch_info(rows, self.device)
        return info

    def _grammar_mask(self, rows: list, info: SamplingBatchInfo) -> torch.Tensor | None:
        """[rows, words] packed allowed tokens (see sampling.bitmask): each constrained row's
        cached state mask, the cached all-ones row for the others."""
        if not info.has_grammar:
            return None
        ones = all_allowed(info.num_words, self.device)
        return stack_bitmasks(
            [ones if row.grammar is None else row.grammar.bitmask(info.stop_ids[i], self.device)
             for i, row in enumerate(rows)], info.num_words)

    def forward_batch(self, batch: Batch,
                      input_ids: list[int] | torch.Tensor | None = None) -> ForwardBatch:
        """The attention-ready view of a batch: device tensors, indptrs and KV indices
        (`input_ids`: instead of `batch.input_ids`, e.g. tokens still on the device)."""
        forward_batch = ForwardBatch.build(
            mode=batch.mode, input_ids=batch.input_ids if input_ids is None else input_ids,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc, req_to_token=self.req_to_token_pool.req_to_token,
            req_to_token_pool=self.req_to_token_pool, kv_storage=self.kv_storage,
            attn_backend=self.attn_backend)
        return forward_batch

    def _input_embeds(self, batch: Batch, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of an EXTEND pass with media: text rows from `embed_tokens` (pad
        ids clamped into the vocabulary first), then the rows of every media span inside this
        pass overwritten with the item's embeddings (whole spans, or the part of a span that
        chunked prefill or a partial cache hit left to this pass)."""
        embeds = self.model.embed_tokens(input_ids.masked_fill(input_ids >= self.vocab_size, 0))
        spans = []  # (first row in this pass, item, first embedding row, end embedding row)
        row = 0
        for mm, start, extend_len in zip(batch.mm_inputs, batch.prefix_lens, batch.extend_lens,
                                         strict=True):
            if mm is not None:
                for item, lo, hi in mm.overlapping(start, start + extend_len):
                    spans.append((row + item.offset + lo - start, item, lo, hi))
            row += extend_len
        if spans:
            media = self.media_cache.get([item for _, item, _, _ in spans],
                                         self.model.embed_media)
            for (dest, _, lo, hi), rows in zip(spans, media, strict=True):
                embeds[dest:dest + hi - lo] = rows[lo:hi].to(embeds.dtype)
        return embeds

    def fill_input_logprobs(self, batch: Batch, hidden: torch.Tensor, out: StepOutput) -> None:
        """Prompt logprobs: the token at position t is scored by the logits at position t - 1."""
        offset = 0
        for i, (span, start, extend_len) in enumerate(zip(batch.input_logprobs,
                                                          batch.prefix_lens, batch.extend_lens,
                                                          strict=True)):
            rows_start = offset
            offset += extend_len
            if span is None:
                continue
            first_row = span.first_target - 1 - start + rows_start
            rows = torch.arange(first_row, first_row + len(span.targets), device=hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            target_ids = torch.tensor(span.targets, device=logprobs.device)
            # Media pad ids (>= vocab_size) are no token of the vocabulary: no logprob.
            chosen = logprobs.gather(1, target_ids.clamp(max=self.vocab_size - 1)[:, None])
            chosen = [c if t < self.vocab_size else None
                      for c, t in zip(chosen.squeeze(1).tolist(), span.targets, strict=True)]
            out.input_logprobs[i] = list(zip(chosen, span.targets, strict=True))
            if span.top_logprobs_num > 0:
                values, ids = logprobs.topk(span.top_logprobs_num, dim=-1)
                out.input_top_logprobs[i] = [
                    list(zip(v, t, strict=True))
                    for v, t in zip(values.tolist(), ids.tolist(), strict=True)]
            else:
                out.input_top_logprobs[i] = [None] * len(span.targets)


class PendingStep:
    """A launched pass: `result()` waits for its device work and returns its StepOutput."""

    def __init__(self, runner: ModelRunner, batch: Batch, hidden: torch.Tensor | None,
                 sample_rows: list[int], sampled: Any) -> None:
        self._runner = runner
        self._batch = batch
        self._hidden = hidden
        self._sample_rows = sample_rows
        self._sampled = sampled

    @torch.inference_mode()
    def result(self) -> StepOutput:
        batch, size = self._batch, self._batch.size
        out = StepOutput([None] * size, [None] * size, [None] * size,
                         [[] for _ in range(size)], [[] for _ in range(size)])
        if batch.mode is ForwardMode.EXTEND:
            self._runner.fill_input_logprobs(batch, self._hidden, out)
        sampled = self._sampled
        if sampled is not None:
            token_ids = sampled.token_ids()  # the step's one wait for the device
            logprobs = sampled.logprobs()
            top_logprobs = sampled.top_logprobs()
            for row, i in enumerate(self._sample_rows):
                out.next_token_ids[i] = token_ids[row]
                out.next_token_logprobs[i] = 0.0 if logprobs is None else logprobs[row]
                if top_logprobs is not None:
                    out.next_top_logprobs[i] = top_logprobs[row]
        self._hidden = self._sampled = None
        return out
