"""Waiting, bounded, until a runtime is idle: no request running or waiting (and, with
`unlocked`, no prefix-cache lock held). The bound only ends a hung test; no assertion depends
on speed."""

from __future__ import annotations

import time
from typing import Any

GUARD_S = 60.0


def wait_idle(runtime: Any, timeout: float = GUARD_S, *, unlocked: bool = False,
              check_integrity: bool = False) -> dict[str, Any]:
    """Polls `runtime.stats()` until idle; returns the idle stats (after `check_integrity()`
    when asked)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = runtime.stats()
        if (not stats["running"] and not stats["waiting"]
                and not (unlocked and stats["protected_tokens"])):
            break
        assert time.monotonic() < deadline, f"runtime not idle: {stats}"
        time.sleep(0.02)
    if check_integrity:
        runtime.check_integrity()
    return stats
