"""The gated activation of the MLP: act(gate) * up over the gate_up projection's two halves."""

from __future__ import annotations

import torch
from torch import nn

from lmnb.runtime.models.layers.fp8 import Fp8Rows
from lmnb.runtime.models.layers.fusion import Fusable

ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
               "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class GatedActivation(Fusable):
    """[tokens, 2 * width] (gate | up) -> act(gate) * up [tokens, width]; SiLU has a fused
    kernel, the other activations always take the torch path."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        self.hidden_act = hidden_act
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused and self.hidden_act == "silu":
            from lmnb.runtime.kernels.fused import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    @property
    def emits_fp8(self) -> bool:
        """Whether `forward_fp8` runs: the fused SiLU kernel."""
        return self.fused and self.hidden_act == "silu"

    def forward_fp8(self, gate_up: torch.Tensor) -> Fp8Rows:
        """`forward(gate_up)` [tokens, 2 * width] quantized per token to FP8 in the same kernel,
        for the W8A8 down projection (`silu_and_mul_quant`; only where `emits_fp8`)."""
        from lmnb.runtime.kernels.fused.activation import silu_and_mul_quant

        assert self.emits_fp8
        return Fp8Rows(*silu_and_mul_quant(gate_up), gate_up.dtype)
