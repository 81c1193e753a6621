"""Compiling Triton kernels for an H100 (sm_90) on a machine without one.

The interpreter (`TRITON_INTERPRET=1`, how CI runs the kernels) skips Triton's code generation, and
Triton decides at decoration time whether a kernel is interpreted: a script that compiles kernels
ahead of time (`triton.compile` with a `GPUTarget`; Triton ships ptxas) runs in a fresh process
without the variable, and prints "compiled" at its end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def assert_compiles_for_sm90(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
