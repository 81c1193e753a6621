"""Fused elementwise Triton kernels of the decoder layer (one launch where torch needs several):

- `rms_norm`: RMSNorm, with the residual add fused in (SGLang's / vLLM's fused_add_rms_norm).
- `silu_and_mul`: SiLU(gate) * up over the two halves of the gate_up projection.
- `rotary_qkv`: neox rotary embedding of q and k straight from the qkv projection, writing q to a
  contiguous tensor and, optionally, the rotated k and v straight into the KV pool's slots.
- `skinny_linear`: x [M <= 16, K] @ weight [N, K]^T, the linear layers and LM head of decode.
- `fp8_gemv`: the same over FP8 (e4m3) weights with per-output-channel scales (W8A16).
- `per_token_quant`: activations to FP8 with one scale per row, before `torch._scaled_mm`;
  `rms_norm_quant` and `silu_and_mul_quant` emit that straight from the norm / the activation.

Each rounds where the torch path (`lmnb/runtime/models/layers/`, the CPU path and the reference)
rounds, so the two agree up to the order of a sum. They run compiled on CUDA and in Triton's
interpreter on CPU tensors (`TRITON_INTERPRET=1`), which the tests use; triton 3.6 and 3.9.
"""

from lmnb.runtime.kernels.fused.activation import silu_and_mul, silu_and_mul_quant
from lmnb.runtime.kernels.fused.fp8_quant import per_token_quant
from lmnb.runtime.kernels.fused.gemv import skinny_linear
from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv
from lmnb.runtime.kernels.fused.rmsnorm import rms_norm, rms_norm_quant
from lmnb.runtime.kernels.fused.rope import rotary_qkv

__all__ = ["fp8_gemv", "per_token_quant", "rms_norm", "rms_norm_quant", "rotary_qkv",
           "silu_and_mul", "silu_and_mul_quant", "skinny_linear"]
