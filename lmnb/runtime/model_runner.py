"""Owns the model, the KV pools and the attention backend; runs one `Batch` and samples from it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmnb.multimodal.embedding_cache import EmbeddingCache
from lmnb.runtime import memory_profile
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.core import Batch, ForwardMode, StepOutput, VerifyOutput
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.graph_runner import DecodeGraphRunner, graph_max_bs
from lmnb.runtime.kernels.base import BackendChoice
from lmnb.runtime.kernels.metadata import host_int64, to_device
from lmnb.runtime.kernels.registry import (
    attention_backend_class,
    create_attention_backend,
    fp8_kv_scales,
    select_attention_backend,
)
from lmnb.runtime.memory import KVStorage, ReqToTokenPool, kv_cache_dtype
from lmnb.runtime.memory.device import device_memory
from lmnb.runtime.memory_profile import MemoryMeter, MemoryPlan, ProfileShape
from lmnb.runtime.models.layers.attention import apply_checkpoint_kv_scales, bind_attention_backend
from lmnb.runtime.models.layers.linear import head_split
from lmnb.runtime.sampling import (
    SampleOutput,
    Sampler,
    SamplingBatchInfo,
    all_allowed,
    stack_bitmasks,
)
from lmnb.runtime.sampling.row import SamplingRow
from lmnb.runtime.speculative.rows import decode_rows
from lmnb.runtime.speculative.verify import draft_bitmasks, expanded_rows, verify_drafts

if TYPE_CHECKING:
    from lmnb.runtime.distributed.group import TPGroup
    from lmnb.runtime.distributed.step import Step


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def sampling_rows(extend_lens: Sequence[int],
                  samples: Sequence[bool]) -> tuple[list[int], list[int]]:
    """(requests that sample, the hidden row of each one's last token)."""
    requests: list[int] = []
    last_token_rows: list[int] = []
    end = 0
    for i, extend_len in enumerate(extend_lens):
        end += extend_len
        if samples[i]:
            requests.append(i)
            last_token_rows.append(end - 1)
    return requests, last_token_rows


def rows_of(hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """hidden[rows] without waiting for the device: indexing a CUDA tensor with a Python list
    copies the list there blockingly, which waits for the whole pass just enqueued."""
    if len(rows) == len(hidden):
        return hidden
    return hidden.index_select(0, to_device(host_int64(rows), hidden.device))


class ModelRunner:
    """Sizes and owns the KV pools from the engine and model configs, and runs the model.

    The attention backend it builds owns the pools and is bound to the model's attention layers
    (`bind_attention_backend`): a pass hands the model only its `ForwardBatch`.

    On CUDA, unless `max_total_tokens` is given, a profile run (`memory_profile`) measures the
    largest passes before the pools exist and `memory_plan` records how the device is shared.

    `device` and `dtype` are the resolved ones (the engine config may say 'auto'). With a
    tensor-parallel group `tp`, `model` is this rank's shard and the KV pools hold this rank's KV
    heads, sized alike on every rank (the smallest device decides); rank 0 `launch`es each batch
    and broadcasts it, the other ranks `follow` (see `distributed/`).

    `row_pass_rows`: the rows of the largest multi-token pass run as decode rows (a speculative
    verify pass, a draft model's catch-up: `position_logits`) that the decode graphs should reach
    (default: the engine's largest verify pass, `SpeculativeConfig.max_verify_rows`)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig,
                 engine_config: EngineConfig, *, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: set[int], tp: TPGroup | None = None,
                 row_pass_rows: int | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.vocab_size = model_config.vocab_size
        heads = head_split(model_config.num_heads, model_config.num_kv_heads,
                           rank=tp.rank if tp else 0, size=tp.size if tp else 1)
        num_layers, num_kv_heads = model_config.num_layers, heads.kv_heads
        head_dim = model_config.head_dim
        self.kv_dtype = kv_cache_dtype(engine_config.kv_cache_dtype, dtype)
        backend = select_attention_backend(engine_config.attention_backend or "auto", device,
                                           dtype=self.kv_dtype, head_dim=head_dim)
        fp8_scales = fp8_kv_scales(backend)
        per_token = KVStorage.bytes_per_token(
            num_layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim, dtype=self.kv_dtype,
            fp8_scales=fp8_scales)
        self._bytes_per_token = per_token
        speculative = engine_config.speculative()
        self._verify_mode = speculative.verify_mode if speculative is not None else "extend"
        if row_pass_rows is None:
            row_pass_rows = speculative.max_verify_rows if speculative is not None else 0
        self._row_pass_rows = row_pass_rows
        self.sampler = Sampler(self.vocab_size, eos_token_ids)
        self.memory_plan: MemoryPlan | None = None
        if engine_config.max_total_tokens:
            self.max_total_tokens = engine_config.max_total_tokens
        else:
            meter = memory_profile.default_meter(device)
            if meter is None:
                self.max_total_tokens = memory_profile.cpu_kv_tokens(
                    available=_available_memory(device), per_token=per_token,
                    mem_fraction_static=engine_config.mem_fraction_static)
            else:
                self.memory_plan = self._plan_memory(meter, engine_config, backend,
                                                     heads.q_heads, num_kv_heads, per_token)
                self.max_total_tokens = self.memory_plan.kv_tokens
        if tp is not None:
            self.max_total_tokens = tp.min_over_ranks(self.max_total_tokens)
            if self.memory_plan is not None:
                self.memory_plan = self.memory_plan.with_tokens(self.max_total_tokens)
        model_context = model_config.context_length
        self.context_len = min(engine_config.context_length or model_context, model_context,
                               self.max_total_tokens)
        self.max_running_requests = engine_config.max_running_requests or min(
            256, max(self.max_total_tokens // 2, 1))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 1,
                                                device)
        self.kv_storage = KVStorage(
            self.max_total_tokens, num_layers=num_layers, kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=self.kv_dtype, device=device, compute_dtype=dtype,
            fp8_scales=fp8_scales)
        apply_checkpoint_kv_scales(model, self.kv_storage)
        self.attn_backend = create_attention_backend(
            backend, num_heads=heads.q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            req_to_token_pool=self.req_to_token_pool, kv_storage=self.kv_storage)
        bind_attention_backend(model, self.attn_backend)
        choice = self.attn_backend.choice
        self.graph_max_bs = graph_max_bs(  # what the engine captures
            device_type=device.type, disable_cuda_graph=engine_config.disable_cuda_graph,
            cuda_graph_max_bs=engine_config.cuda_graph_max_bs,
            backend_name=choice.name if choice else "custom",
            supports_capture=self.attn_backend.supports_capture,
            max_running_requests=self.max_running_requests,
            verify_rows=self._row_pass_rows)
        self.verify_graph_replays = 0  # verify passes that replayed a decode graph
        self._batch_info: SamplingBatchInfo | None = None
        self.graph_runner: DecodeGraphRunner | None = None
        self.media_cache = EmbeddingCache()
        self._last_sampled: torch.Tensor | None = None  # [bs] ids the last launch sampled
        self._shared_prefix_decode = (not engine_config.disable_shared_prefix_decode
                                      and self.attn_backend.supports_shared_prefixes)
        if tp is not None:
            tp.steps.reserve(self.max_running_requests)

    def _plan_memory(self, meter: MemoryMeter, config: EngineConfig, backend: BackendChoice,
                     q_heads: int, kv_heads: int, per_token: int) -> MemoryPlan:
        """Profiles the largest passes the engine will run, then sizes the KV pool from what is
        free (see memory_profile). Sizes not yet known are bounded: 256 running requests unless
        given, the model's context unless a smaller one is given."""
        mc = self.model_config
        max_running = config.max_running_requests or 256
        shape = ProfileShape(
            prefill_tokens=config.prefill_chunk_size(self.device.type),
            max_running_requests=max_running,
            graph_max_bs=graph_max_bs(
                device_type=self.device.type, disable_cuda_graph=config.disable_cuda_graph,
                cuda_graph_max_bs=config.cuda_graph_max_bs, backend_name=backend.name,
                supports_capture=attention_backend_class(backend.name).supports_capture,
                max_running_requests=max_running, verify_rows=self._row_pass_rows),
            context_len=min(config.context_length or mc.context_length, mc.context_length))
        profile = memory_profile.profile_activations(
            self.model, shape, meter, attention_backend=backend, q_heads=q_heads,
            kv_heads=kv_heads, head_dim=mc.head_dim, num_layers=mc.num_layers, dtype=self.dtype,
            kv_dtype=self.kv_dtype, device=self.device, vocab_size=self.vocab_size,
            sampler=self.sampler)
        free, total = meter.device_memory()
        activations = profile.activation_bytes
        if backend.name == "torch_native" and self.device.type == "cuda":
            activations = max(activations,
                              int(total * memory_profile.TORCH_NATIVE_ACTIVATION_FRACTION))
        return memory_profile.plan_kv_pool(
            total=total, free=free, weights=self.weight_bytes,
            activations=activations, graphs=profile.graph_bytes,
            fixed=profile.fixed_bytes, per_token=per_token,
            mem_fraction_static=config.mem_fraction_static, profile_seconds=profile.seconds)

    def memory_report(self) -> dict[str, Any]:
        """How the device's memory is shared out (`stats()['memory']`); without a profile run
        (CPU, or `max_total_tokens` given) only the weights and the KV pool."""
        if self.memory_plan is not None:
            return self.memory_plan.report()
        gib = memory_profile.GIB
        return {"weights_gb": round(self.weight_bytes / gib, 3),
                "kv_gb": round(self.max_total_tokens * self._bytes_per_token / gib, 3),
                "kv_tokens": self.max_total_tokens}

    def capture_cuda_graphs(self, max_bs: int) -> None:
        """Captures decode graphs for batches of up to `max_bs` rows (CUDA only): requests, or
        the rows of a verify pass in decode form (`speculative/rows.py`)."""
        limit = max(self.max_running_requests, self._row_pass_rows)
        self.graph_runner = DecodeGraphRunner(self.model, self.attn_backend,
                                              max_bs=min(max_bs, limit), device=self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (this rank's shard)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def media_counters(self) -> dict[str, int]:
        """Vision-tower runs (one per new image/video embedded) and the embeddings cache."""
        cache = self.media_cache
        return {"vision_tower_runs": cache.runs, "media_embedding_hits": cache.hits,
                "media_embedding_cache_bytes": cache.bytes}

    def stats(self) -> dict[str, Any]:
        """This runner's part of `Runtime.stats()`: attention backend, an FP8 KV pool's scales
        ("token" | "tensor"), decode graphs, memory (the plan's, and the device's now:
        `device_memory`), tensor-parallel steps sent, media counters."""
        graphs, tp, choice = self.graph_runner, self.tp, self.attn_backend.choice
        return {
            "attention_backend": choice.name if choice else "custom",
            "kv_fp8_scales": self.kv_storage.fp8_scales if self.kv_storage.is_fp8 else None,
            "tp_steps_sent": tp.steps.forwards_sent if tp else 0,
            "tp_step_send_seconds": tp.steps.send_seconds if tp else 0.0,
            "cuda_graph_batch_sizes": list(graphs.ladder) if graphs else [],
            "cuda_graph_capture_seconds": graphs.capture_seconds if graphs else 0.0,
            "cuda_graph_replays": graphs.replays if graphs else 0,
            "cuda_graph_precompiled_kernels": graphs.precompiled_kernels if graphs else 0,
            "verify_graph_replays": self.verify_graph_replays,
            "memory": self.memory_report(), "device_memory": device_memory(self.device),
            **self.media_counters()}

    def release_graphs(self) -> None:
        """Drops the decode CUDA graphs (before a tensor-parallel communicator they captured
        goes away)."""
        if self.graph_runner is not None:
            torch.cuda.synchronize(self.device)
            self.graph_runner = None

    def close(self) -> None:
        self.media_cache.clear()
        self.graph_runner = None
        self.kv_storage.release()
        bind_attention_backend(self.model, None)
        self.model = None

    def run(self, batch: Batch, rows: Sequence[SamplingRow]) -> StepOutput:
        """Forward `batch`; sample one token for each request with `batch.samples[i]`, whose
        sampling state is `rows` (in batch order)."""
        return self.launch(batch, rows).result()

    @torch.inference_mode()
    def launch(self, batch: Batch, rows: Sequence[SamplingRow]) -> PendingStep:
        """Enqueues the forward pass and the sampling on the device and starts the copies of
        their results to the host; `result()` waits for them. With `batch.follows_previous`
        the input ids are the tokens the previous launch sampled (still on the device).
        Tensor-parallel rank 0 first broadcasts the batch; any failure then is final
        (`TPGroup.fail`: the ranks may be out of step)."""
        if self.tp is None:
            return self._launch(batch, rows)
        self.tp.check()
        try:
            return self._launch(batch, rows)
        except BaseException as error:
            self.tp_failed(error)
            raise

    def tp_failed(self, error: BaseException) -> None:
        """A tensor-parallel step failed: every later one raises (the clearer error, e.g. which
        worker died, is raised now when there is one)."""
        assert self.tp is not None
        self.tp.fail(error)
        self.tp.check()

    def _launch(self, batch: Batch, rows: Sequence[SamplingRow]) -> PendingStep:
        input_ids: list[int] | torch.Tensor = batch.input_ids
        if batch.follows_previous:
            input_ids = self._previous_tokens(batch)
        forward_batch = self.forward_batch(batch, input_ids)
        if self.tp is not None:
            self.tp.steps.send_forward(batch, forward_batch, self.span_rows(batch))
        hidden, graph_logits = self._forward(forward_batch, batch)
        sample_rows, last_token_rows = sampling_rows(batch.extend_lens, batch.samples)
        sampled = None
        self._last_sampled = None
        if sample_rows:
            logits = (graph_logits if graph_logits is not None
                      else self.model.compute_logits(rows_of(hidden, last_token_rows)))
            rows = list(rows)
            info = self._sampling_info(rows)
            sampled = self.sampler(logits, info, self._grammar_mask(rows, info))
            info.advance(sampled.next_token_ids)
            self._last_sampled = sampled.next_token_ids  # one per sampling row, in order
        return PendingStep(self, batch, hidden, sample_rows, sampled)

    @torch.inference_mode()
    def verify(self, batch: Batch, rows: Sequence[SamplingRow]) -> VerifyOutput:
        """A speculative verify pass (`batch.drafts`; `rows`: every request's sampling state):
        one forward over each request's last token and drafts (`_verify_logits`: a decode CUDA
        graph's replay where one fits), the target's logits at every position, and per request
        the tokens it keeps (`speculative.verify`)."""
        if self.tp is not None:
            raise RuntimeError("speculative verify passes do not run tensor-parallel")
        logits = self._verify_logits(batch)
        rows = list(rows)
        info = self.sampler.batch_info(expanded_rows(rows, batch.drafts), self.device)
        self._batch_info = None  # outputs grew by several tokens: rebuilt for the next decode
        self._last_sampled = None
        return verify_drafts(self.sampler, logits, info,
                             draft_bitmasks(rows, batch.drafts, info, self.device), batch.drafts)

    def _verify_logits(self, batch: Batch) -> torch.Tensor:
        """[positions, vocab] logits of a verify pass: as decode rows (a CUDA graph replay when
        the rows fit one, else eagerly) or as one EXTEND (see `SpeculativeConfig.verify_mode`;
        "auto": decode rows where they replay a graph, else one EXTEND)."""
        mode = self._verify_mode
        as_rows = mode == "decode" or (mode == "auto" and self.rows_replay(batch))
        graphs = self.graph_runner
        replays = graphs.replays if graphs is not None else 0
        logits = self.position_logits(batch, as_rows=as_rows)
        if graphs is not None and graphs.replays > replays:
            self.verify_graph_replays += 1
        return logits

    def rows_replay(self, batch: Batch) -> bool:
        """Whether `batch` (EXTEND-shaped: requests feeding several tokens) in decode-row form
        (`speculative/rows.py`) fits a captured decode graph."""
        graphs = self.graph_runner
        return graphs is not None and sum(batch.extend_lens) <= graphs.max_bs

    @torch.inference_mode()
    def position_logits(self, batch: Batch, rows: Sequence[int] | None = None, *,
                        as_rows: bool) -> torch.Tensor:
        """Logits of the EXTEND-shaped `batch` at its token rows `rows` (default: every token;
        [len(rows), vocab]), the forward run as decode rows (`as_rows`: a decode graph replays
        it when it fits, see `rows_replay`) or as one eager EXTEND. A speculative verify pass's,
        and a draft model's catch-up pass's."""
        if as_rows:
            hidden, logits = self._forward(self._decode_rows(batch))
        else:
            hidden, logits = self._forward(self.forward_batch(batch), batch)
        index = None if rows is None else host_int64(
            rows, pin=self.device.type == "cuda").to(self.device, non_blocking=True)
        if logits is not None:
            return logits if index is None else logits.index_select(0, index)
        assert hidden is not None
        return self.model.compute_logits(hidden if index is None
                                         else hidden.index_select(0, index))

    def _decode_rows(self, batch: Batch) -> ForwardBatch:
        """`batch` as a DECODE batch of one row per token (`speculative.rows.decode_rows`)."""
        layout = decode_rows(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens,
                             shared_prefix=self._shared_prefix_decode)
        return ForwardBatch.build(
            mode=ForwardMode.DECODE, input_ids=batch.input_ids,
            req_pool_indices=layout.req_pool_indices, prefix_lens=layout.prefix_lens,
            extend_lens=[1] * layout.size, out_cache_loc=batch.out_cache_loc,
            req_to_token=self.req_to_token_pool.req_to_token,
            shared_prefixes=layout.shared_prefixes)

    def _previous_tokens(self, batch: Batch) -> torch.Tensor:
        """The input ids of a `follows_previous` batch: the last launch's sampled tokens (all,
        or the `previous_rows` of the requests that go on), still on the device; rows -1 take
        their id from `batch.input_ids`. A row that could not sample (MASKED, NOT_FINITE) reads
        id 0: its request ends when the last pass's result is read, and this pass's row for it
        is dropped."""
        last, rows = self._last_sampled, batch.previous_rows
        if last is not None:
            last = last.clamp(min=0)
        known = last.numel() if last is not None else -1
        if rows is None and known == batch.size:
            return last
        if rows is None or len(rows) != batch.size or not rows or max(rows) >= known:
            raise RuntimeError("follows_previous without a matching previous pass")
        pin = self.device.type == "cuda"
        if min(rows) >= 0:
            index = host_int64(rows, pin=pin)
            return last.index_select(0, index.to(self.device, non_blocking=True))
        if min(rows) < -1 or len(batch.input_ids) != batch.size:
            raise RuntimeError("follows_previous: rows -1 need their input ids")
        both = host_int64([*rows, *batch.input_ids], pin=pin).to(self.device, non_blocking=True)
        index, given = both[:batch.size], both[batch.size:]
        return torch.where(index >= 0, last.index_select(0, index.clamp(min=0)), given)

    @torch.inference_mode()
    def follow(self, step: Step) -> None:
        """Tensor-parallel ranks > 0: rank 0's `launch` + `result` of the same batch on this
        rank's shard, the same collectives in the same order (the sampled rows' logits, then the
        prompt-logprob rows'); nothing is sampled."""
        forward_batch = ForwardBatch.build(
            mode=step.mode, input_ids=step.input_ids, req_pool_indices=step.req_pool_indices,
            prefix_lens=step.prefix_lens, extend_lens=step.extend_lens,
            out_cache_loc=step.out_cache_loc, req_to_token=self.req_to_token_pool.req_to_token,
            kv_indices=step.kv_indices)
        hidden, graph_logits = self._forward(forward_batch)
        if graph_logits is not None:
            return
        _, last_token_rows = sampling_rows(step.extend_lens, step.samples)
        if last_token_rows:
            self.model.compute_logits(rows_of(hidden, last_token_rows))
        if step.mode is ForwardMode.EXTEND:
            for span in step.spans:
                if span is not None:
                    self.model.compute_logits(hidden[span[0]:span[0] + span[1]])

    def _forward(self, forward_batch: ForwardBatch, batch: Batch | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states, None) of an eager pass, or (None, logits) of a CUDA-graph replay.
        An EXTEND `batch` with media feeds the model its spliced `input_embeds`."""
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return None, self.graph_runner.replay(forward_batch)  # decode: every row samples
        self.attn_backend.init_forward_metadata(forward_batch)
        if batch is not None and batch.mode is ForwardMode.EXTEND and batch.has_media:
            embeds = self._input_embeds(batch, forward_batch.input_ids)
            return self.model(forward_batch.input_ids.clamp(max=self.vocab_size - 1),
                              forward_batch.positions, forward_batch, input_embeds=embeds), None
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch), None

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
        return ForwardBatch.build(
            mode=batch.mode, input_ids=batch.input_ids if input_ids is None else input_ids,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc, req_to_token=self.req_to_token_pool.req_to_token,
            shared_prefixes=batch.shared_prefixes)

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

    @staticmethod
    def span_rows(batch: Batch) -> list[tuple[int, int] | None]:
        """Per request: (first hidden row, rows) scoring its prompt logprobs in this pass: the
        token at position t is scored by the logits at position t - 1."""
        if batch.mode is not ForwardMode.EXTEND:
            return [None] * batch.size
        rows: list[tuple[int, int] | None] = []
        offset = 0
        for span, start, extend_len in zip(batch.input_logprobs, batch.prefix_lens,
                                           batch.extend_lens, strict=True):
            rows.append(None if span is None
                        else (span.first_target - 1 - start + offset, len(span.targets)))
            offset += extend_len
        return rows

    def fill_input_logprobs(self, batch: Batch, hidden: torch.Tensor, out: StepOutput) -> None:
        """Prompt logprobs of the requests that asked, in request order."""
        for i, (span, span_rows) in enumerate(zip(batch.input_logprobs, self.span_rows(batch),
                                                  strict=True)):
            if span is None or span_rows is None:
                continue
            first_row = span_rows[0]
            rows = torch.arange(first_row, first_row + len(span.targets), device=hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1,
                                         dtype=torch.float32)
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
            if span.token_ids:
                asked = logprobs[:, torch.tensor(span.token_ids, device=logprobs.device)]
                out.input_token_ids_logprobs[i] = [list(zip(row, span.token_ids, strict=True))
                                                   for row in asked.tolist()]
            else:
                out.input_token_ids_logprobs[i] = [None] * len(span.targets)


class PendingStep:
    """A launched pass: `result()` waits for its device work and returns its StepOutput."""

    def __init__(self, runner: ModelRunner, batch: Batch, hidden: torch.Tensor | None,
                 sample_rows: list[int], sampled: SampleOutput | None) -> None:
        self._runner = runner
        self._batch = batch
        self._hidden = hidden
        self._sample_rows = sample_rows
        self._sampled = sampled

    @torch.inference_mode()
    def result(self) -> StepOutput:
        if self._runner.tp is None:
            return self._result()
        try:
            return self._result()
        except BaseException as error:
            self._runner.tp_failed(error)
            raise

    def _result(self) -> StepOutput:
        batch = self._batch
        out = StepOutput.empty(batch.size)
        if batch.mode is ForwardMode.EXTEND:
            self._runner.fill_input_logprobs(batch, self._hidden, out)
        sampled = self._sampled
        if sampled is not None:
            failed = sampled.wait()  # the step's one wait for the device
            token_ids = sampled.token_ids()
            logprobs = sampled.logprobs()
            top_logprobs = sampled.top_logprobs()
            asked = sampled.token_ids_logprobs()
            for row, i in enumerate(self._sample_rows):
                if row in failed:  # it alone ends, with the reason
                    out.failed[i] = failed[row]
                    continue
                out.next_token_ids[i] = token_ids[row]
                out.next_token_logprobs[i] = 0.0 if logprobs is None else logprobs[row]
                if top_logprobs is not None:
                    out.next_top_logprobs[i] = top_logprobs[row]
                if asked is not None:
                    out.next_token_ids_logprobs[i] = asked[row]
        self._hidden = self._sampled = None
        return out
