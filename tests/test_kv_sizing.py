"""KV pool sizing: the budget arithmetic, and the profile run (on CPU through a fake meter)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmnb.runtime import memory_profile
from lmnb.runtime.engine import Runtime
from lmnb.runtime.kernels.base import BackendChoice
from lmnb.runtime.memory_profile import (
    GIB,
    SLOT_BOOKKEEPING_BYTES,
    ProfileShape,
    cpu_kv_tokens,
    plan_kv_pool,
    profile_activations,
    safety_margin,
)
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers.attention import PooledAttention
from lmnb.runtime.sampling import Sampler

MIB = 1 << 20
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


class FakeMeter:
    """A device of `total` bytes with `free` free; every measured peak is `peak` bytes."""

    def __init__(self, *, free: int, total: int, peak: int = 0) -> None:
        self.free, self.total, self.peak_bytes = free, total, peak
        self.starts = 0

    def device_memory(self) -> tuple[int, int]:
        return self.free, self.total

    def allocated(self) -> int:
        return 0

    def start(self) -> None:
        self.starts += 1

    def peak(self) -> int:
        return self.peak_bytes


def test_plan_without_fraction_is_what_is_free_less_the_needs() -> None:
    plan = plan_kv_pool(total=80 * GIB, free=60 * GIB, weights=16 * GIB, activations=3 * GIB,
                        graphs=GIB, fixed=GIB // 2, per_token=128 * 1024,
                        mem_fraction_static=None)
    margin = safety_margin(80 * GIB)
    assert margin == int(80 * GIB * memory_profile.SAFETY_MARGIN_FRACTION)
    budget = 60 * GIB - 3 * GIB - GIB - GIB // 2 - margin
    assert plan.kv_tokens == budget // (128 * 1024 + SLOT_BOOKKEEPING_BYTES)
    used = plan.weight_bytes + plan.kv_bytes + plan.activation_bytes + plan.graph_bytes \
        + plan.fixed_bytes + plan.margin_bytes
    assert used <= plan.total_bytes
    report = plan.report()
    assert report["kv_tokens"] == plan.kv_tokens and report["weights_gb"] == 16.0
    assert report["activations_peak_gb"] == 3.0 and report["cuda_graph_reserve_gb"] == 1.0


def test_plan_margin_floor_and_explicit_margin() -> None:
    assert safety_margin(4 * GIB) == memory_profile.MIN_SAFETY_MARGIN
    plan = plan_kv_pool(total=GIB, free=GIB, weights=0, activations=0, graphs=0, fixed=0,
                        per_token=MIB - SLOT_BOOKKEEPING_BYTES, mem_fraction_static=None,
                        margin=0)
    assert plan.kv_tokens == 1024


def test_plan_with_fraction_keeps_sglang_meaning() -> None:
    total, free, per_token = 80 * GIB, 62 * GIB, MIB
    plan = plan_kv_pool(total=total, free=free, weights=16 * GIB, activations=2 * GIB,
                        graphs=GIB, fixed=0, per_token=per_token, mem_fraction_static=0.8)
    # weights + everything else in use (total - free) + KV == 80% of the device
    assert plan.kv_tokens == (int(total * 0.8) - (total - free)) // (per_token
                                                                      + SLOT_BOOKKEEPING_BYTES)
    assert plan.mem_fraction_static == 0.8


def test_plan_with_fraction_that_starves_activations_raises() -> None:
    with pytest.raises(ValueError, match="mem_fraction_static=0.95.*needs"):
        plan_kv_pool(total=80 * GIB, free=62 * GIB, weights=16 * GIB, activations=5 * GIB,
                     graphs=GIB, fixed=0, per_token=MIB, mem_fraction_static=0.95)


def test_plan_with_fraction_that_eats_the_margin_warns() -> None:
    # left beside weights + KV: 8 GB; needs 7 GB; margin 3.2 GB
    with pytest.warns(RuntimeWarning, match="safety margin"):
        plan = plan_kv_pool(total=80 * GIB, free=62 * GIB, weights=16 * GIB,
                            activations=6 * GIB, graphs=GIB, fixed=0, per_token=MIB,
                            mem_fraction_static=0.9)
    assert plan.kv_tokens == (72 * GIB - 18 * GIB) // (MIB + SLOT_BOOKKEEPING_BYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_kv_pool(total=80 * GIB, free=62 * GIB, weights=16 * GIB, activations=GIB,
                     graphs=GIB, fixed=0, per_token=MIB, mem_fraction_static=0.85)


def test_plan_errors_when_nothing_fits() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan_kv_pool(total=16 * GIB, free=2 * GIB, weights=14 * GIB, activations=2 * GIB,
                     graphs=0, fixed=0, per_token=MIB, mem_fraction_static=None)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan_kv_pool(total=16 * GIB, free=2 * GIB, weights=14 * GIB, activations=0, graphs=0,
                     fixed=0, per_token=MIB, mem_fraction_static=0.5)


def test_cpu_policy() -> None:
    assert cpu_kv_tokens(available=100 * GIB, per_token=1024, mem_fraction_static=None) \
        == memory_profile.CPU_MAX_DEFAULT_TOKENS
    assert cpu_kv_tokens(available=GIB, per_token=MIB, mem_fraction_static=None) \
        == int(GIB * 0.15 // MIB)
    assert cpu_kv_tokens(available=100 * GIB, per_token=MIB, mem_fraction_static=0.5) \
        == 50 * 1024
    with pytest.raises(ValueError):
        cpu_kv_tokens(available=MIB, per_token=MIB, mem_fraction_static=None)


def _tiny_profile(tiny_models, *, max_running_requests: int, graph_max_bs: int):
    """The tiny GQA model's activation profile (torch-native attention, 40 prefill tokens,
    contexts of 16) over a fake meter: (model, config, meter, profile)."""
    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))
    meter = FakeMeter(free=GIB, total=2 * GIB, peak=3 * MIB)
    profile = profile_activations(
        model, ProfileShape(prefill_tokens=40, max_running_requests=max_running_requests,
                            graph_max_bs=graph_max_bs, context_len=16), meter,
        attention_backend=BackendChoice("torch_native", "asked for by name"),
        q_heads=config.num_heads,
        kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_layers=config.num_layers, dtype=torch.float32, device=torch.device("cpu"),
        vocab_size=config.vocab_size, sampler=Sampler(config.vocab_size, {2}))
    return model, config, meter, profile


def test_profile_routine_runs_every_pass_on_cpu(tiny_models) -> None:
    """The profile's passes (graph buffers included) on a tiny model; fake readings."""
    model, config, meter, profile = _tiny_profile(tiny_models, max_running_requests=6,
                                                  graph_max_bs=4)  # the chunk spans 3 requests
    assert meter.starts == 3  # prefill, decode, graph-size decode
    assert profile.activation_bytes == 3 * MIB
    # the pool's measured peak, plus the logits outputs graphs 1 and 2 keep
    assert profile.graph_bytes == 3 * MIB + 4 * config.vocab_size * (1 + 2)
    # the layers were bound to the temporary pools only for the passes: nothing keeps them alive
    layers = [m for m in model.modules() if isinstance(m, PooledAttention)]
    assert len(layers) == config.num_layers and all(m.attn_backend is None for m in layers)


def test_profile_reserves_the_shared_prefix_variants_temporary_logits(tiny_models,
                                                                      monkeypatch) -> None:
    """A backend with shared-prefix graph variants: each variant writes its logits into the
    plain graph's, but while it is captured its own logits sit in the pool beside them, so the
    pool holds one more [max_bs, vocab] block than the measured plain decode."""
    from lmnb.runtime.kernels.torch_native import TorchNativeAttention

    monkeypatch.setattr(TorchNativeAttention, "supports_shared_prefixes", True)
    monkeypatch.setattr(TorchNativeAttention, "prefix_variants", (64, 16))
    _, config, _, profile = _tiny_profile(tiny_models, max_running_requests=8, graph_max_bs=8)
    # graphs 1, 2 and 4 keep their logits; graph 8's are in the measured pool, and so many
    # rows again for its variants' logits while captured
    assert profile.graph_bytes == 3 * MIB + 4 * config.vocab_size * (1 + 2 + 4 + 8)


def test_runtime_sized_by_profile_generates_like_one_without(tiny_models, monkeypatch) -> None:
    """A profile run before the pools exist leaves nothing behind: same greedy tokens."""
    folder = tiny_models["llama-gqa"]
    prompts = [[5, 17, 99, 1000, 42], [7] * 30]
    with Runtime(folder, device="cpu", max_total_tokens=2048) as rt:
        expected = [out["output_ids"] for out in rt.generate(input_ids=prompts,
                                                             sampling_params=GREEDY)]
        assert rt.stats()["memory"]["kv_tokens"] == 2048
    meter = FakeMeter(free=520 * MIB, total=GIB, peak=MIB)
    monkeypatch.setattr(memory_profile, "default_meter", lambda device: meter)
    with Runtime(folder, device="cpu", chunked_prefill_size=64,
                 max_running_requests=8) as rt:
        got = [out["output_ids"] for out in rt.generate(input_ids=prompts,
                                                        sampling_params=GREEDY)]
        memory = rt.stats()["memory"]
        rt.check_integrity()
    assert got == expected
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    assert memory["kv_tokens"] == rt.max_total_tokens \
        == (520 * MIB - MIB - memory_profile.MIN_SAFETY_MARGIN) // (per_token
                                                                    + SLOT_BOOKKEEPING_BYTES)
    assert memory["activations_peak_gb"] == round(MIB / GIB, 3)
    assert meter.starts == 2  # no graphs on CPU: prefill and decode
