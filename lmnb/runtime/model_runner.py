"""Owns the model, the KV pools and the attention backend; runs one `Batch` and samples from it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.registry import create_attention_backend
from lmnb.runtime.memory import ReqToTokenPool, TokenToKVPool
from lmnb.runtime.models.llama import head_dim_of
from lmnb.runtime.sampling import Sampler

TopLogprobs = list[tuple[float, int]]
CPU_KV_MEMORY_FRACTION = 0.15  # of the host's available memory, when no size is given on CPU
CPU_MAX_DEFAULT_TOKENS = 65536


@dataclass
class StepOutput:
    """Per request of a batch: the sampled token (None when the request did not sample)."""

    next_token_ids: list[int | None]
    next_token_logprobs: list[float | None]
    next_top_logprobs: list[TopLogprobs | None]
    input_logprobs: list[list[tuple[float, int]]]  # prompt logprobs computed in this pass
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
    def __init__(self, model: torch.nn.Module, config, *, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: set[int], max_total_tokens: int | None,
                 mem_fraction_static: float | None, max_running_requests: int | None,
                 context_length: int | None, attention_backend: str) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = head_dim_of(config)
        per_token = TokenToKVPool.bytes_per_token(
            num_layers=config.num_hidden_layers, kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=dtype)
        self.max_total_tokens = max_total_tokens or self._kv_budget(per_token, mem_fraction_static)
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        model_context = config.max_position_embeddings
        self.context_len = min(context_length or model_context, model_context,
                               self.max_total_tokens)
        self.max_running_requests = max_running_requests or min(
            256, max(self.max_total_tokens // 2, 1))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 1,
                                                device)
        self.token_to_kv_pool = TokenToKVPool(
            self.max_total_tokens, num_layers=config.num_hidden_layers, kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=dtype, device=device)
        self.attn_backend = create_attention_backend(
            attention_backend, device=device, num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool)
        self.sampler = Sampler(self.vocab_size, eos_token_ids)

    def _kv_budget(self, per_token: int, mem_fraction_static: float | None) -> int:
        available = _available_memory(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # Weights + KV pool; the rest is for activations (torch-native decode gathers the
            # padded K/V of the whole batch per layer, so it needs room).
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

    def close(self) -> None:
        self.token_to_kv_pool.k_buffers.clear()
        self.token_to_kv_pool.v_buffers.clear()
        self.model = None

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOutput:
        forward_batch = self._forward_batch(batch)
        hidden = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        sample_rows: list[int] = []
        last_token_rows: list[int] = []
        end = 0
        for i, extend_len in enumerate(batch.extend_lens):
            end += extend_len
            if batch.samples[i]:
                sample_rows.append(i)
                last_token_rows.append(end - 1)
        size = len(batch.reqs)
        out = StepOutput([None] * size, [None] * size, [None] * size,
                         [[] for _ in range(size)], [[] for _ in range(size)])
        if batch.mode is ForwardMode.EXTEND:
            self._input_logprobs(batch, hidden, out)
        if sample_rows:
            logits = self.model.compute_logits(hidden[last_token_rows])
            sampling_reqs = [batch.reqs[i] for i in sample_rows]
            sampled = self.sampler(logits, sampling_reqs, self._grammar_mask(sampling_reqs, logits))
            token_ids = sampled.next_token_ids.tolist()
            logprobs = sampled.next_token_logprobs.tolist()
            for row, i in enumerate(sample_rows):
                out.next_token_ids[i] = token_ids[row]
                out.next_token_logprobs[i] = logprobs[row]
                if sampled.top_logprobs is not None:
                    out.next_top_logprobs[i] = sampled.top_logprobs[row]
        return out

    def _grammar_mask(self, reqs: list, logits: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] allowed tokens of constrained requests (all allowed for the others)."""
        if all(req.grammar is None for req in reqs):
            return None
        mask = torch.ones(logits.shape, dtype=torch.bool)
        stop_ids = self.sampler.eos_token_ids
        for row, req in enumerate(reqs):
            if req.grammar is not None:
                allowed = req.grammar.mask(stop_ids | set(req.sampling_params.stop_token_ids))
                mask[row].zero_()
                width = min(allowed.numel(), mask.shape[1])
                mask[row, :width] = allowed[:width]
        return mask.to(logits.device)

    def _forward_batch(self, batch: Batch) -> ForwardBatch:
        """The attention-ready view of a batch: device tensors, indptrs and KV indices."""
        input_ids: list[int] = []
        for req, start, extend_len in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                          strict=True):
            input_ids.extend(req.fill_slice(start, start + extend_len))
        forward_batch = ForwardBatch.build(
            mode=batch.mode, input_ids=input_ids,
            req_pool_indices=[req.req_pool_idx for req in batch.reqs],
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc, req_to_token=self.req_to_token_pool.req_to_token,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend)
        self.attn_backend.init_forward_metadata(forward_batch)
        return forward_batch

    def _input_logprobs(self, batch: Batch, hidden: torch.Tensor, out: StepOutput) -> None:
        """Prompt logprobs: the token at position t is scored by the logits at position t - 1."""
        offset = 0
        for i, (req, start, extend_len) in enumerate(zip(batch.reqs, batch.prefix_lens,
                                                         batch.extend_lens, strict=True)):
            rows_start = offset
            offset += extend_len
            if not req.wants_input_logprobs:
                continue
            first_target = max(req.input_logprobs_needed_from, 1, start + 1)
            last_target = min(start + extend_len, len(req.origin_input_ids) - 1)
            if first_target > last_target:
                continue
            rows = torch.arange(first_target - 1, last_target, device=hidden.device)
            rows = rows - start + rows_start
            targets = req.origin_input_ids[first_target:last_target + 1]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            target_ids = torch.tensor(targets, device=logprobs.device)
            chosen = logprobs.gather(1, target_ids[:, None]).squeeze(1).tolist()
            out.input_logprobs[i] = list(zip(chosen, targets, strict=True))
            if req.top_logprobs_num > 0:
                values, ids = logprobs.topk(req.top_logprobs_num, dim=-1)
                out.input_top_logprobs[i] = [
                    list(zip(v, t, strict=True))
                    for v, t in zip(values.tolist(), ids.tolist(), strict=True)]
            else:
                out.input_top_logprobs[i] = [None] * len(targets)

