"""Triton kernels compiled side by side before a pass launches them (the memory profile's passes,
the decode graphs' captures).

A fresh machine (no Triton cache) spends most of an engine's start compiling kernels one at a
time, each when it is first launched: MLIR and LLVM passes, then ptxas and the C compiler of its
launcher, which are separate processes. `compile_side_by_side(launches)` runs `launches` once
with every launch that would compile recorded and skipped (no compile, no launch: the outputs of
those kernels are left unwritten, so `launches` must be a pass whose results are thrown away,
e.g. a graph's warm-up forward, and must not index with them), then compiles what it recorded in
a pool of threads (Triton's own `preload` of each specialization; the external tools release the
interpreter) and loads each onto the device. The launches that follow find them compiled.

Triton's hook is one for the whole process, so the recording belongs to the thread that runs
`launches`: another thread's launches meanwhile (a second engine's scheduler, this module's own
compile pool) go to the hook that was installed before, or compile and launch as usual.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from triton import knobs
from triton.knobs import JITHookCompileInfo
from triton.runtime.jit import JITFunction, JitFunctionInfo

MAX_WORKERS = 16

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Specialization:
    """One kernel as a launch would compile it (Triton's serialized specialization)."""

    kernel: JITFunction
    data: str


class _Recorders:
    """The process's one `jit_cache_hook` while any thread records: a launch on a recording
    thread is recorded and skipped, any other thread's is passed to the hook installed before
    the first recording began (none: it compiles and launches as usual)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, dict[tuple[int, str], Specialization]] = {}
        self._outer: Callable[..., bool | None] | None = None  # triton.knobs.JITHook

    def start(self) -> dict[tuple[int, str], Specialization]:
        thread = threading.get_ident()
        with self._lock:
            if thread in self._by_thread:
                raise RuntimeError("record_compiles is already recording on this thread")
            if not self._by_thread:
                self._outer = knobs.runtime.jit_cache_hook
                knobs.runtime.jit_cache_hook = self.hook
            recorded: dict[tuple[int, str], Specialization] = {}
            self._by_thread[thread] = recorded
            return recorded

    def stop(self) -> None:
        with self._lock:
            del self._by_thread[threading.get_ident()]
            if not self._by_thread:
                if knobs.runtime.jit_cache_hook == self.hook:  # unless replaced meanwhile
                    knobs.runtime.jit_cache_hook = self._outer
                self._outer = None

    def hook(self, *, key: str, repr: str, fn: JitFunctionInfo, compile: JITHookCompileInfo,
             is_manual_warmup: bool, already_compiled: bool) -> bool | None:
        recorded = self._by_thread.get(threading.get_ident())
        if recorded is None:
            outer = self._outer
            return outer(key=key, repr=repr, fn=fn, compile=compile,
                         is_manual_warmup=is_manual_warmup,
                         already_compiled=already_compiled) if outer is not None else None
        recorded.setdefault((id(fn.jit_function), key),
                            Specialization(fn.jit_function, compile["specialization_data"]))
        return True  # skip: nothing compiled or launched


_RECORDERS = _Recorders()


def record_compiles(launches: Callable[[], object]) -> list[Specialization]:
    """Runs `launches` with every launch on this thread that would compile recorded and skipped
    (see the module docstring); each specialization once. Nothing when `launches` fails: the
    caller's real launches compile one by one as without this pass (and raise the error
    there)."""
    recorded = _RECORDERS.start()
    try:
        launches()
    except Exception:  # noqa: BLE001  # the same launches follow for real and raise there
        logger.debug("recording the kernels to compile failed", exc_info=True)
        return []
    finally:
        _RECORDERS.stop()
    return list(recorded.values())


def compile_all(specializations: list[Specialization], device: torch.device,
                workers: int | None = None) -> int:
    """Compiles and loads each specialization in a pool of threads (into its kernel's cache, as
    its first launch would); how many were. One that fails here is left to its first launch,
    which compiles it as without this pass (and raises there if it must)."""
    if not specializations:
        return 0
    workers = workers or min(MAX_WORKERS, os.cpu_count() or 1, len(specializations))

    def build(spec: Specialization) -> bool:
        try:
            with torch.cuda.device(device):
                compiled = spec.kernel.preload(spec.data)
                compiled.run  # noqa: B018  # loads the module and builds its launcher
        except Exception:  # noqa: BLE001  # see the docstring: its launch compiles it
            logger.debug("preloading %s failed", spec.kernel, exc_info=True)
            return False
        return True

    with ThreadPoolExecutor(workers, thread_name_prefix="lmnb-compile") as pool:
        return sum(pool.map(build, specializations))


def compile_side_by_side(launches: Callable[[], object], device: torch.device) -> int:
    """`record_compiles(launches)` then `compile_all`; the number of kernels compiled."""
    return compile_all(record_compiles(launches), device)
