"""The side-by-side compile's recording pass (kernels/precompile.py) on the CPU: Triton calls its
`jit_cache_hook` as a launch that would compile; the GPU test that compiles for real is
tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JitFunctionInfo

from lmnb.runtime.kernels import precompile


@triton.jit
def _one_kernel(X):
    tl.store(X, 1)


def _would_compile(key: str, data: str) -> bool | None:
    """What a launch that misses the kernel cache asks the hook."""
    hook = knobs.runtime.jit_cache_hook
    assert hook is not None
    return hook(key=key, repr="_one_kernel",
                fn=JitFunctionInfo(__name__, "_one_kernel", _one_kernel),
                compile={"key": key, "specialization_data": data}, is_manual_warmup=False,
                already_compiled=False)


def test_launches_that_would_compile_are_recorded_once_and_skipped() -> None:
    answers = []

    def launches() -> None:
        for key, data in (("a", "spec-a"), ("b", "spec-b"), ("a", "spec-a")):
            answers.append(_would_compile(key, data))

    previous = knobs.runtime.jit_cache_hook
    recorded = precompile.record_compiles(launches)
    assert answers == [True, True, True]  # True: Triton neither compiles nor launches
    assert [spec.data for spec in recorded] == ["spec-a", "spec-b"]
    assert knobs.runtime.jit_cache_hook is previous


def test_a_failing_pass_records_nothing_and_restores_the_hook() -> None:
    def launches() -> None:
        _would_compile("a", "spec-a")
        raise RuntimeError("a forward failed")

    previous = knobs.runtime.jit_cache_hook
    assert precompile.record_compiles(launches) == []
    assert knobs.runtime.jit_cache_hook is previous
    with pytest.raises(KeyboardInterrupt):  # not an error to hide
        precompile.record_compiles(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert knobs.runtime.jit_cache_hook is previous


def test_nothing_recorded_compiles_nothing() -> None:
    assert precompile.compile_side_by_side(lambda: None, device=None) == 0  # type: ignore[arg-type]
