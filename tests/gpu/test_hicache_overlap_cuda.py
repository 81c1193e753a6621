"""Overlapped hierarchical-cache loads on CUDA (`hicache/loads.py`): the copies run on their own
stream and the compute stream waits for each layer's event only where attention reads it.

- A load held back on its stream (a spin kernel queued first) is still what a reader sees after
  `KVStorage.ready`: the compute stream really waits (without the wait it reads the old rows).
- Greedy fp32 outputs are the computed ones whether prefixes are computed, hit on the device,
  loaded from host memory (overlapped) or from disk pages read ahead, through every attention
  backend installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.memory import KVStorage
from tests.test_hicache_runtime import OPTIONS, check_tiers, computed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(
    package is not None and importlib.util.find_spec(package) is None,
    reason=f"{package} is not installed"))
    for name, package in (("flashinfer", "flashinfer"), ("triton", "triton"),
                          ("torch_native", None))]


def test_the_compute_stream_waits_for_each_layer_of_a_held_back_load() -> None:
    device = torch.device("cuda")
    layers, n = 4, 3000
    kv = KVStorage(8192, num_layers=layers, kv_heads=4, head_dim=64, dtype=torch.bfloat16,
                   device=device)
    pool = HostKVPool(4096, kv)
    source = torch.arange(1, n + 1, device=device)
    for layer in range(layers):
        kv.k_buffers[layer].zero_()
        kv.v_buffers[layer].zero_()
        rows = torch.randn(n, 4, 64, device=device, dtype=torch.bfloat16)
        kv.set_kv(layer, source, rows, rows + 1)
    host = torch.cat((pool.allocator.alloc(n // 2), pool.allocator.alloc(n - n // 2)))
    ticket = pool.save(source[:n // 2], host[:n // 2])
    pool.save(source[n // 2:], host[n // 2:])
    pool.fence(ticket)
    torch.cuda.synchronize()
    target = torch.arange(4000, 4000 + n, device=device).flip(0)
    pool.load(host, target)
    with torch.cuda.stream(pool.loads.stream):
        torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of spinning
    sums = []
    for layer in range(layers):
        kv.ready(layer)  # as attention does, on the compute stream
        sums.append((kv.k_buffers[layer][target].float() - kv.k_buffers[layer][source].float())
                    .abs().sum())
        sums.append((kv.v_buffers[layer][target].float() - kv.v_buffers[layer][source].float())
                    .abs().sum())
    assert torch.stack(sums).sum().item() == 0.0
    assert kv.pending is None
    counters = pool.loads.read_counters()
    assert counters.loads == 1 and counters.tokens == n
    assert counters.waited_seconds > 0 and counters.load_seconds > 0  # it stood at the waits
    pool.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapped_loads_give_the_computed_tokens(tiny_models, tmp_path: Path,
                                                   backend: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    options = dict(OPTIONS, device="cuda", attention_backend=backend)
    model = tiny_models["llama-gqa"]
    check_tiers(model, options, computed(model, options), tmp_path)
