"""`tl.dot` operands as the Triton mode needs them: the interpreter (triton 3.9) computes bf16
dots wrongly, so under it bf16 operands are fed as float32 (`dot_upcast` at the launch,
`dot_operand` in the kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.interpreter import INTERPRETED


def dot_upcast(dtype: torch.dtype) -> bool:
    """Feed tl.dot float32 operands: the interpreter (triton 3.9) computes bf16 dots wrongly."""
    return dtype == torch.bfloat16 and INTERPRETED


@triton.jit
def dot_operand(x, UPCAST: tl.constexpr):
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x
