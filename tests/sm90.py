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


COMPILE_HELPER = '''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile(fn, signature, constants, warps=4, aligned=()):
    """`fn` compiled for sm_90 as an H100 launches it: with programmatic dependent launch where
    the kernel takes USE_PDL (kernels/pdl.py), whose wait must then be in the PTX."""
    if "USE_PDL" in fn.arg_names:
        constants = {**constants, "USE_PDL": True}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    signature = {**signature, **{name: "constexpr" for name in constants}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert ("griddepcontrol.wait" in kernel.asm["ptx"]) == ("USE_PDL" in constants), fn
    return kernel
'''


def assert_compiles_for_sm90(script: str) -> None:
    """Runs `script` after `COMPILE_HELPER` (its `compile(fn, signature, constants, ...)`)."""
    script = COMPILE_HELPER + script
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
