"""The side-by-side compile's recording pass (kernels/precompile.py) on the CPU: Triton calls its
`jit_cache_hook` as a launch that would compile; the GPU test that compiles for real is
tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import threading

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


def _in_thread(fn) -> object:
    """`fn()`'s result, run on a thread of its own."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_another_threads_launches_meanwhile_go_to_the_hook_installed_before() -> None:
    """A second engine's launches (another thread) are neither recorded nor skipped while one
    engine records: they reach the previous hook, or compile as usual where there is none."""
    seen = []

    def outer(**kwargs) -> bool:
        seen.append(kwargs["key"])
        return False

    elsewhere: list[object] = []

    def launches() -> None:
        _would_compile("mine", "spec-mine")
        elsewhere.append(_in_thread(lambda: _would_compile("theirs", "spec-theirs")))

    knobs.runtime.jit_cache_hook = outer
    try:
        recorded = precompile.record_compiles(launches)
        assert knobs.runtime.jit_cache_hook is outer
        knobs.runtime.jit_cache_hook = None
        recorded_without_outer = precompile.record_compiles(launches)
    finally:
        knobs.runtime.jit_cache_hook = None
    assert [spec.data for spec in recorded] == ["spec-mine"]
    assert [spec.data for spec in recorded_without_outer] == ["spec-mine"]
    assert elsewhere == [False, None]  # None: Triton compiles and launches
    assert seen == ["theirs"]


def test_two_threads_record_side_by_side_each_its_own() -> None:
    """Two engines starting at once: each records its own thread's launches, also those made
    while the other records; the hook is given back only when both are done (here the one that
    began first ends first)."""
    first_recording, second_recording, first_done = (threading.Event(), threading.Event(),
                                                      threading.Event())

    def first() -> None:
        _would_compile("a", "spec-a")
        first_recording.set()
        assert second_recording.wait(60)
        _would_compile("c", "spec-c")

    def second_launches() -> None:
        _would_compile("b", "spec-b")
        second_recording.set()
        assert first_done.wait(60)
        _would_compile("d", "spec-d")

    def second() -> list[precompile.Specialization]:
        assert first_recording.wait(60)
        return precompile.record_compiles(second_launches)

    previous = knobs.runtime.jit_cache_hook
    recorded_by_second: list[object] = []
    thread = threading.Thread(target=lambda: recorded_by_second.append(second()))
    thread.start()
    try:
        recorded_by_first = precompile.record_compiles(first)
        assert knobs.runtime.jit_cache_hook is not previous  # the second still records
    finally:
        first_done.set()
        thread.join()
    assert [spec.data for spec in recorded_by_first] == ["spec-a", "spec-c"]
    assert [spec.data for spec in recorded_by_second[0]] == ["spec-b", "spec-d"]
    assert knobs.runtime.jit_cache_hook is previous
