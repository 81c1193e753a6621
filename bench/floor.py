"""The hardware floor of a schedule: what the passes the scheduler actually ran must cost at least.

Per forward pass, from the model's shapes and the pass's lengths:
- bytes: the weights a pass reads (every linear layer and the LM head, one embedding row per
  token) plus the KV it reads (each request's whole KV after the pass) and writes (its new
  tokens);
- FLOPs: 2 * (linear parameters) per token, 2 * hidden * vocab per sampled row (only those get
  logits), and attention's 4 * layers * heads * head_dim per (query, key) pair it scores
  (causal: a new token at position p scores p + 1 keys).

A DECODE pass costs at least max(bytes / copy bandwidth, FLOPs / matmul rate); an EXTEND pass at
least FLOPs / matmul rate (the issue's definition) — `pass_floor` reports the max of both terms
for it too, which is still a lower bound, and keeps the FLOP-only sum apart. Both rates are
measured on the device in the same run (`measure_rates`): a device-to-device copy of 1 GiB
(read + write bytes per second) and the model dtype's GEMM of the model's own MLP shape.

`BatchLog` is the scheduler hook (`Runtime.set_batch_hook`) that records what ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmnb.runtime.config import ModelConfig
from lmnb.runtime.core import Batch, ForwardMode


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step constants of a decoder's cost."""

    linear_params: int  # all decoder-layer linear weights (q, k, v, o, gate, up, down)
    head_params: int  # the LM head (hidden * vocab)
    other_weight_bytes: int  # norms (read every pass), in bytes
    hidden: int
    elem: int  # bytes per weight/KV element
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # 4 * layers * heads * head_dim

    @classmethod
    def from_config(cls, config: ModelConfig, dtype: torch.dtype) -> ModelCost:
        elem = torch.empty((), dtype=dtype).element_size()
        h, d = config.hidden_size, config.head_dim
        per_layer = (h * (config.num_heads + 2 * config.num_kv_heads) * d
                     + config.num_heads * d * h + 3 * h * config.intermediate_size)
        return cls(linear_params=config.num_layers * per_layer,
                   head_params=h * config.vocab_size,
                   other_weight_bytes=(2 * config.num_layers + 1) * h * elem,
                   hidden=h, elem=elem,
                   kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * d * elem,
                   attn_flops_per_pair=4 * config.num_layers * config.num_heads * d)

    def pass_cost(self, prefix_lens: list[int], extend_lens: list[int],
                  sampled: int) -> tuple[float, float]:
        """(bytes, FLOPs) of one pass."""
        tokens = sum(extend_lens)
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens,
                                                             strict=True))
        flops = (2 * self.linear_params * tokens + 2 * self.head_params * sampled
                 + self.attn_flops_per_pair * pairs)
        kv_tokens = sum(prefix_lens) + tokens  # read after this pass's write
        weight_bytes = ((self.linear_params + (self.head_params if sampled else 0)) * self.elem
                        + self.other_weight_bytes + tokens * self.hidden * self.elem)
        data_bytes = weight_bytes + self.kv_bytes_per_token * (kv_tokens + tokens)
        return float(data_bytes), float(flops)


@dataclass
class BatchLog:
    """Records every forward pass (mode, lengths, sampled rows) the scheduler runs; install with
    `runtime.set_batch_hook(log)`. Called on the scheduler thread: it copies three small lists."""

    passes: list[tuple[ForwardMode, list[int], list[int], int]] = field(default_factory=list)

    def __call__(self, batch: Batch) -> None:
        self.passes.append((batch.mode, list(batch.prefix_lens), list(batch.extend_lens),
                            sum(batch.samples)))

    def clear(self) -> None:
        self.passes.clear()


def schedule_floor(log: BatchLog, cost: ModelCost, *, copy_bytes_per_s: float,
                   matmul_flops_per_s: float) -> dict[str, Any]:
    """Sums the floors of the logged passes; seconds split by mode and by the bound that won."""
    totals = {"decode_passes": 0, "extend_passes": 0, "decode_seconds": 0.0,
              "extend_seconds": 0.0, "extend_flop_seconds": 0.0, "decode_memory_bound_passes": 0,
              "extend_memory_bound_passes": 0, "decode_tokens": 0, "extend_tokens": 0,
              "bytes": 0.0, "flops": 0.0}
    for mode, prefix_lens, extend_lens, sampled in log.passes:
        data_bytes, flops = cost.pass_cost(prefix_lens, extend_lens, sampled)
        memory_s, compute_s = data_bytes / copy_bytes_per_s, flops / matmul_flops_per_s
        kind = "decode" if mode is ForwardMode.DECODE else "extend"
        totals[f"{kind}_passes"] += 1
        totals[f"{kind}_seconds"] += max(memory_s, compute_s)
        totals[f"{kind}_memory_bound_passes"] += memory_s > compute_s
        totals[f"{kind}_tokens"] += sum(extend_lens)
        if kind == "extend":
            totals["extend_flop_seconds"] += compute_s
        totals["bytes"] += data_bytes
        totals["flops"] += flops
    totals["seconds"] = totals["decode_seconds"] + totals["extend_seconds"]
    # The definition: decode max(bytes, FLOPs), prefill FLOPs only.
    totals["seconds_issue_definition"] = totals["decode_seconds"] + totals["extend_flop_seconds"]
    return totals


def copy_bandwidth(device: torch.device, size: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), best of 3 timed batches."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            target.copy_(source)
        torch.cuda.synchronize(device)
        best = max(best, 2 * size * 5 / (time.perf_counter() - start))
    del source, target
    return best


def matmul_rate(device: torch.device, dtype: torch.dtype, *, m: int, k: int, n: int) -> float:
    """FLOP/s of [m, k] @ [k, n] in `dtype` (the model's MLP shape at a prefill-sized m), best of
    3 timed batches."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
        best = max(best, 2 * m * k * n * 10 / (time.perf_counter() - start))
    del a, b
    return best


def measure_rates(device: torch.device, config: ModelConfig,
                  dtype: torch.dtype) -> dict[str, float]:
    """The two rates of the floor, measured now on `device` (CUDA)."""
    return {"copy_bytes_per_s": copy_bandwidth(device),
            "matmul_flops_per_s": matmul_rate(device, dtype, m=8192, k=config.hidden_size,
                                              n=2 * config.intermediate_size)}
