"""A Runtime with the hierarchical cache: greedy fp32 outputs are the same whether a prefix is
computed, hit on the device, loaded back from host memory, or loaded from disk pages by a new
Runtime on the same model (chunked prefill, forks and batches in between)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

from lmnb import Runtime

try:
    from lmnb.widgets import CacheDashboard

    WIDGETS = True
except ImportError:  # the notebook extra is not installed
    WIDGETS = False

OPTIONS = dict(max_total_tokens=320, chunked_prefill_size=48, check_integrity_each_step=True,
               device="cpu", dtype="float32")
GREEDY = dict(max_new_tokens=6, temperature=0)


def _prompts() -> tuple[list[int], list[list[int]], list[list[int]]]:
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(140)]  # a few-shot prefix, 2+ pages
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(12)] for _ in range(3)]
    fillers = [[rng.randrange(100, 40000) for _ in range(150)] for _ in range(3)]
    return shared, prompts, fillers


def _ids(runtime: Runtime, prompts: list[list[int]]) -> list[list[int]]:
    results = runtime.generate(input_ids=prompts, sampling_params=GREEDY)
    return [r["output_ids"] for r in results]


def computed(model: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Everything computed: no prefix reuse at all."""
    _, prompts, fillers = _prompts()
    with Runtime(model, disable_radix_cache=True, **options) as runtime:
        return {"prompts": _ids(runtime, prompts), "fillers": _ids(runtime, fillers)}


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, Any]:
    return computed(tiny_models["llama-gqa"], OPTIONS)


def test_outputs_identical_across_tiers(tiny_models, reference, tmp_path: Path) -> None:
    check_tiers(tiny_models["llama-gqa"], OPTIONS, reference, tmp_path)


def check_tiers(model: Path, base: dict[str, Any], reference: dict[str, Any],
                storage: Path) -> None:
    """Computed, device hits (batch, n=2 forks), host hits after fillers pushed the prompts out
    of the pool, then disk hits in a new Runtime: the reference tokens every time."""
    shared, prompts, fillers = _prompts()
    options = dict(base, enable_hierarchical_cache=True, hicache_ratio=2.0,
                   hicache_storage_backend="file", hicache_storage_dir=str(storage))
    with Runtime(model, **options) as runtime:
        # computed (one at a time), then a device hit (batch + n=2 forks of one prompt)
        assert [_ids(runtime, [p])[0] for p in prompts] == reference["prompts"]
        results = runtime.generate(input_ids=prompts, sampling_params=dict(GREEDY, n=2))
        assert [r["output_ids"] for r in results[::2]] == reference["prompts"]
        assert [r["output_ids"] for r in results[1::2]] == reference["prompts"]
        assert min(r["meta_info"]["cached_tokens"] for r in results) >= len(shared)
        # the fillers push the prompts out of the 320-slot pool: into the host tier
        assert _ids(runtime, fillers) == reference["fillers"]
        assert runtime.cache_snapshot() and {"host", "device+host"} & {
            row["tier"] for row in runtime.cache_snapshot()}
        before = runtime.stats()["hicache_host_loaded_tokens"]
        results = runtime.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == reference["prompts"]
        stats = runtime.stats()
        assert stats["hicache_host_loaded_tokens"] - before >= len(shared)
        assert stats["hicache_loads"] >= 1  # queued, copied layer by layer as attention read
        assert min(r["meta_info"]["cached_tokens"] for r in results) >= len(shared)
        if importlib.util.find_spec("IPython") is not None:  # the GPU machine has none
            from lmnb.magics.status import StatusSummary

            rows = dict(StatusSummary("tiny", stats).rows())
            assert "host tier" in rows and "disk tier" in rows
        if WIDGETS:
            dashboard = CacheDashboard(runtime, interval_s=None)
            assert "tiers: device" in repr(dashboard)
            assert dashboard.stats["hicache_host_loaded_tokens"] >= len(shared)
            dashboard.close()
        runtime.check_integrity()
    with Runtime(model, **options) as runtime:  # a new runtime: the disk pages only
        results = runtime.generate(input_ids=prompts[:1], sampling_params=GREEDY)
        assert results[0]["output_ids"] == reference["prompts"][0]
        assert results[0]["meta_info"]["cached_tokens"] == 128  # two full 64-token pages
        results = runtime.generate(input_ids=prompts, sampling_params=dict(GREEDY, n=2))
        assert [r["output_ids"] for r in results[::2]] == reference["prompts"]
        stats = runtime.stats()
        assert stats["hicache_disk_loaded_tokens"] >= 128 and stats["hicache_prefetch_reads"] >= 1
        runtime.check_integrity()


def test_flush_cache_with_a_pin_drops_the_host_tier_too(tiny_models) -> None:
    """`flush_cache` keeps a pinned prefix and nothing else: not a host copy of a flushed prompt
    either (evicting saves to the host pool; a flush must not)."""
    shared, prompts, _ = _prompts()
    options = dict(OPTIONS, enable_hierarchical_cache=True, hicache_ratio=2.0,
                   hicache_write_policy="write_through")
    with Runtime(tiny_models["llama-gqa"], **options) as runtime:
        _ids(runtime, [prompts[0]])
        runtime.pin_prefix(input_ids=shared[:40])
        assert runtime.flush_cache()
        again = runtime.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] <= 40  # only the pinned prefix
        stats = runtime.stats()
        assert stats["hicache_host_loaded_tokens"] == 0
        assert stats["hicache_host_only_tokens"] == 0
        runtime.check_integrity()


def test_a_failed_pass_leaves_no_kv_on_disk(tiny_models, reference, tmp_path: Path) -> None:
    """With the overlap schedule a prefill pass's prompts are cached when it is launched; when
    its result then fails, `drop_unlocked` empties the device and host tiers. The disk tier
    gets only computed KV (`persist`, a finished request's): no page of the failed pass is
    written, so neither a retry nor a new runtime is served KV that was never computed."""
    prompt = _prompts()[1][0]  # 152 tokens: two full pages in the first pass
    options = dict(OPTIONS, chunked_prefill_size=256, enable_hierarchical_cache=True,
                   hicache_ratio=2.0, hicache_storage_backend="file",
                   hicache_storage_dir=str(tmp_path), disable_overlap_schedule=False)

    class DeviceFault(RuntimeError):
        pass

    class FaultyPass:  # what a pass whose kernels failed reports at its first wait
        def result(self) -> None:
            raise DeviceFault("the device failed while running the pass")

    with Runtime(tiny_models["llama-gqa"], **options) as runtime:
        runner = runtime._runner
        real_launch, faults = runner.launch, []

        def launch(batch, rows):
            if not faults and batch.mode.name == "EXTEND":
                faults.append(batch)
                return FaultyPass()
            return real_launch(batch, rows)

        runner.launch = launch
        try:
            failed = runtime.generate(input_ids=prompt, sampling_params=GREEDY)
        finally:
            runner.launch = real_launch
        assert faults and failed["meta_info"]["finish_reason"]["type"] == "abort"
        runtime._cache.disk.flush()
        again = runtime.generate(input_ids=prompt, sampling_params=GREEDY)  # a retry
        runtime.check_integrity()
    with Runtime(tiny_models["llama-gqa"], **options) as runtime:  # a restart
        later = runtime.generate(input_ids=prompt, sampling_params=GREEDY)
        assert later["meta_info"]["cached_tokens"] == 128  # the retry's pages
    assert again["output_ids"] == later["output_ids"] == reference["prompts"][0]
