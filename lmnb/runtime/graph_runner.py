"""CUDA graphs of the decode pass: the model's forward and the logits of every row, captured once
per batch size of a ladder, replayed with the step's inputs copied into static buffers.

    static input_ids / positions / out_cache_loc [max_bs]   rows n..bs of a replay are padding:
    backend.prepare_for_replay(fb, bs)                       token 0 at position 0 writing slot 0,
    graph[bs].replay() -> logits[bs][:n]                     attending to slot 0 only

A replay reads nothing from the host, so one decode step costs a handful of launches instead of
a few per layer and op (the host cost that dominated eager decode).

Speculative verify passes replay the same graphs: a verify pass of requests with k_i drafts runs as
a decode batch of sum(k_i + 1) rows, row j of request i reading its KV row up to its position j
(`speculative/rows.py`), so every (batch, k) shape whose rows fit the ladder replays; the ladder
reaches `verify_rows` when speculation is configured (`graph_max_bs`).

`capture=False` (tests, and CPU): nothing is captured and a "replay" runs the model eagerly on the
same padded static batch through the same backend hooks, so the padded-shape path is exercised
where CUDA graphs do not exist.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.precompile import compile_side_by_side
from lmnb.runtime.models.layers.attention import bound_to

SHARED_MIN_BS = 8  # smallest batch captured in the shared-prefix variant too


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, every 8 up to 128, every 16 after (a padded row costs little), and `max_bs`."""
    sizes = ([bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, min(max_bs, 129), 8))
             + list(range(144, max_bs, 16)) + [max_bs])
    return sorted(set(sizes))


MAX_VERIFY_ROWS = 256  # rows of a verify pass captured at most (requests x (drafts + 1))


def graph_max_bs(*, device_type: str, disable_cuda_graph: bool, cuda_graph_max_bs: int | None,
                 backend_name: str, supports_capture: bool, max_running_requests: int,
                 verify_rows: int = 0) -> int:
    """Largest decode batch (rows) to capture (0: eager decode). On CUDA unless disabled; with
    the torch-native backend only when asked for (`cuda_graph_max_bs`), since its captured decode
    gathers K/V padded to the whole context. `verify_rows`: the rows of the largest speculative
    verify pass (`speculative_max_batch_size` x `speculative_num_draft_tokens`); the ladder
    reaches them (up to MAX_VERIFY_ROWS) even where decode batches are capped lower."""
    if device_type != "cuda" or disable_cuda_graph or not supports_capture:
        return 0
    if cuda_graph_max_bs is not None:
        decode = min(cuda_graph_max_bs, max_running_requests)
    elif backend_name == "torch_native":
        return 0
    else:
        decode = min(max_running_requests, 256)
    return max(decode, min(verify_rows, MAX_VERIFY_ROWS))


class DecodeGraphRunner:
    """Captures `model`'s decode over `backend`, the attention backend bound to its layers (the
    model runner's): the capture/replay hooks set the static metadata the layers' `forward`
    then reads."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, *, max_bs: int,
                 device: torch.device, capture: bool = True) -> None:
        if not backend.supports_capture:
            raise ValueError(f"{type(backend).__name__} does not support CUDA-graph capture")
        if not bound_to(model, backend):  # the hooks would set metadata the layers never read
            raise ValueError("the model's attention layers are not bound to this backend "
                             "(bind_attention_backend)")
        self.model = model
        self.backend = backend
        self.max_bs = max_bs
        self.device = device
        self.ladder = batch_size_ladder(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.capture = capture
        # keyed by (batch size, shared-prefix variant: its tile height, 0 for plain decode)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.variants = (0, *backend.prefix_variants) if backend.supports_shared_prefixes else (0,)
        self.keys = {(bs, rows) for bs in self.ladder for rows in self.variants
                     if bs >= SHARED_MIN_BS or not rows}
        self.replays = 0
        self.precompiled_kernels = 0
        self._pool: Any = None
        start = time.perf_counter()
        backend.init_capture(max_bs)
        if capture:
            with torch.inference_mode():
                self.precompiled_kernels = compile_side_by_side(self._dry_forwards, device)
                for bs, rows in self._capture_order():
                    self._capture(bs, prefix_rows=rows)
            torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start

    def bucket(self, rows: int) -> int:
        """The captured batch size a pass of `rows` rows replays (rows <= max_bs)."""
        return self.ladder[bisect.bisect_left(self.ladder, rows)]

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.mode is ForwardMode.DECODE
                and forward_batch.batch_size <= self.max_bs
                and self.backend.can_replay(forward_batch))

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """[n, vocab] logits of the decode batch `forward_batch` (n requests)."""
        n = forward_batch.batch_size
        bs = self.bucket(n)
        for static, value in ((self.input_ids, forward_batch.input_ids),
                              (self.positions, forward_batch.positions),
                              (self.out_cache_loc, forward_batch.out_cache_loc)):
            static[:n].copy_(value, non_blocking=True)
            if bs > n:
                static[n:bs].zero_()
        key = (bs, self.backend.prefix_rows(forward_batch))
        if key not in self.keys:  # below SHARED_MIN_BS: plain decode
            key = (bs, 0)
        self.backend.prepare_for_replay(forward_batch, bs, prefix_rows=key[1])
        self.replays += 1
        if not self.capture:  # the padded static batch, eagerly
            return self._forward(self._static_batch(bs))[:n]
        self.graphs[key].replay()
        return self.logits[key][:n]

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The ForwardBatch the captured forward sees: only mode and the static token buffers are
        read (the backend's own static metadata stands for the rest)."""
        zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
        indptr = torch.arange(bs + 1, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=zeros, prefix_lens=zeros, extend_lens=zeros + 1,
            seq_lens=zeros + 1, qo_indptr=indptr, kv_indptr=indptr, kv_indices=zeros,
            prefix_lens_cpu=[0] * bs, extend_lens_cpu=[1] * bs, seq_lens_cpu=[1] * bs,
            num_kv_tokens=bs)

    def _forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return self.model.compute_logits(hidden)

    def _capture_order(self) -> list[tuple[int, int]]:
        """The keys in capture order: the largest batch first (smaller ones reuse its pool),
        plain before its variants (they write its logits)."""
        return [(bs, rows) for bs in reversed(self.ladder) for rows in self.variants
                if (bs, rows) in self.keys]

    def _dry_forwards(self) -> None:
        """Every captured (batch size, variant)'s forward once, eagerly, as its capture will
        launch it (its Triton kernels recorded and skipped by `compile_side_by_side`: the
        outputs are garbage, read by nothing)."""
        for bs, rows in self._capture_order():
            self.backend.prepare_for_capture(bs, prefix_rows=rows)
            self._forward(self._static_batch(bs))

    def _capture(self, bs: int, *, prefix_rows: int) -> None:
        """The graph of `bs` rows in one variant. A shared-prefix variant copies its logits into
        the plain graph's (one [bs, vocab] buffer a batch size, not one a variant: 0.7 GB of
        Llama-3 logits a variant over the ladder)."""
        forward_batch = self._static_batch(bs)
        self.backend.prepare_for_capture(bs, prefix_rows=prefix_rows)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        first = not any(key[1] == prefix_rows for key in self.graphs)
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy inits)
            for _ in range(2 if first else 1):
                self._forward(forward_batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(forward_batch)
            if prefix_rows:
                self.logits[bs, 0].copy_(logits)
        self.logits[bs, prefix_rows] = self.logits[bs, 0] if prefix_rows else logits
        self._pool = graph.pool()
        self.graphs[bs, prefix_rows] = graph
