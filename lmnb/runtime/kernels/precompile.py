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
"""

from __future__ import annotations

import logging
import os
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


def record_compiles(launches: Callable[[], object]) -> list[Specialization]:
    """Runs `launches` with every launch that would compile recorded and skipped (see the module
    docstring); each specialization once. Nothing when `launches` fails: the caller's real
    launches compile one by one as without this pass (and raise the error there)."""
    recorded: dict[tuple[int, str], Specialization] = {}

    def record(*, key: str, repr: str, fn: JitFunctionInfo, compile: JITHookCompileInfo,
               is_manual_warmup: bool, already_compiled: bool) -> bool:
        recorded.setdefault((id(fn.jit_function), key),
                            Specialization(fn.jit_function, compile["specialization_data"]))
        return True  # skip: nothing compiled or launched

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        launches()
    except Exception:  # noqa: BLE001  # the same launches follow for real and raise there
        logger.debug("recording the kernels to compile failed", exc_info=True)
        return []
    finally:
        knobs.runtime.jit_cache_hook = previous
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
