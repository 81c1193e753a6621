"""The packed-logprobs kernel (lmnb/runtime/sampling/logprob_kernel.py) gives what log_softmax,
gather and topk give, in the interpreter on CPU and compiled on CUDA; it compiles for sm_90."""

import pytest
import torch

from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import Sampler, logprob_kernel, sampler
from lmnb.runtime.scheduler import ReqState

pytestmark = SAME_TRITON_MODE


def _reference(raw: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, ids.clamp(min=0)[:, None])
    values, top = logprobs.topk(k, dim=-1)
    return torch.cat([ids[:, None].float(), chosen, values, top.float()], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 5, 11, 16])
def test_kernel_matches_log_softmax_and_topk(device: str, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    raw = torch.randn(4, 9000, generator=gen) * 4  # a partial last block
    raw[1, :8980] = float("-inf")  # padded / impossible tokens: 20 left
    raw[2, 8999] = 60.0  # the best token in the last column
    raw[3, 4096:8192] += 5.0  # the best tokens all in one block
    raw[3, 100] = 30.0  # ... but one
    ids = torch.tensor([7, 8990, 8999, -1])  # -1: a row that could not be sampled
    raw, ids = raw.to(device), ids.to(device)
    out = logprob_kernel.packed_logprobs(raw, ids, k).cpu()
    expected = _reference(raw.cpu(), ids.cpu(), k)
    assert out.shape == (4, 2 + 2 * k)
    assert torch.equal(out[:, 0], expected[:, 0])  # the sampled ids, -1 included
    torch.testing.assert_close(out[:, 1:2 + k], expected[:, 1:2 + k], atol=2e-5, rtol=0)
    assert torch.equal(out[:, 2 + k:], expected[:, 2 + k:])  # random values: no ties


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_reads_bf16_as_its_float32_upcast(device: str) -> None:
    """bf16 logits read as they are (the model's dtype) give exactly their upcast's result."""
    gen = torch.Generator().manual_seed(7)
    raw = (torch.randn(3, 5000, generator=gen) * 4).bfloat16()
    raw[0, 4999] = 40.0
    raw[1, :4990] = float("-inf")
    ids = torch.tensor([4999, 4995, 12])
    raw, ids = raw.to(device), ids.to(device)
    out = logprob_kernel.packed_logprobs(raw, ids, 5)
    assert torch.equal(out, logprob_kernel.packed_logprobs(raw.float(), ids, 5))
    assert out[0, 2 + 5] == 4999


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_through_the_kernel_matches_torch_ops(device: str, monkeypatch) -> None:
    """The sampler's logprobs of the rows that ask (some rows do not), through the kernel and
    through torch ops: the same ids and top ids, logprobs to float rounding."""
    def state(top: int, asks: bool) -> ReqState:
        return ReqState(Req(origin_input_ids=[1, 2], sampling_params=SamplingParams(
            temperature=0.0), return_logprob=asks, top_logprobs_num=top))

    rows = [state(3, True), state(0, False), state(1, True), state(0, True)]
    logits = torch.randn(4, 9000, generator=torch.Generator().manual_seed(3)).to(device)
    sampling = Sampler(9000, {2})
    results = []
    for devices in ((), (device,)):
        monkeypatch.setattr(sampler, "KERNEL_DEVICES", devices)
        out = sampling(logits, sampling.batch_info(rows, device))
        results.append((out.token_ids(), out.logprobs(), out.top_logprobs()))
    (ids, logprobs, tops), (kernel_ids, kernel_logprobs, kernel_tops) = results
    assert kernel_ids == ids and [len(t) for t in kernel_tops] == [3, 0, 1, 0]
    assert [[t for _, t in row] for row in kernel_tops] == [[t for _, t in row] for row in tops]
    torch.testing.assert_close(torch.tensor(kernel_logprobs), torch.tensor(logprobs),
                               atol=2e-5, rtol=0)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmnb.runtime.sampling import logprob_kernel
signature = {"RAW": "*fp32", "IDS": "*i64", "OUT": "*fp32", "vocab": "i32", "stride": "i32",
             "out_stride": "i32", "K": "i32", "KP": "constexpr", "BLOCK": "constexpr"}
for kp, raw in ((2, "*fp32"), (8, "*fp32"), (16, "*fp32"), (8, "*bf16")):
    signature["RAW"] = raw
    triton.compile(ASTSource(fn=logprob_kernel._packed_logprobs_kernel, signature=signature,
                             constexprs={"KP": kp, "BLOCK": 4096}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("compiled")
"""


def test_kernel_compiles_for_a_hopper_gpu() -> None:
    assert_compiles_for_sm90(_COMPILE)
