"""Whether this process's Triton kernels run in Triton's interpreter (`TRITON_INTERPRET=1`: CPU
tensors, the tests' path) rather than compiled; Triton decides it when a kernel is decorated."""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
