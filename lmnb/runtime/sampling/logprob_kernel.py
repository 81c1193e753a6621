"""The sampled token's logprob and the best k logprobs of each row in one Triton launch.

At batch 1 a decode step is host-bound: each eager op costs the host a dispatch (~13 us on the
H100 host), and `torch.topk` over a vocabulary-wide row launches a dozen radix-select kernels.
`packed_logprobs` reads each row once (an online log-sum-exp and a running top-k of at most
`MAX_K` slots) and writes the row's packed result (`SampleOutput.packed_logprobs`):

    [n, 2 + 2k] float32: ids[i], its logprob, the k best logprobs (best first), their ids

The values are the raw log-softmax as `torch.log_softmax` computes it, up to float rounding;
tied values come in any order, as from `torch.topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16  # top logprobs per row the kernel keeps; wider asks go through torch
_BLOCK = 4096  # a vocabulary of 50k-150k in 13-37 steps


@triton.jit
def _packed_logprobs_kernel(RAW, IDS, OUT, vocab, stride, out_stride, K,
                            KP: tl.constexpr, BLOCK: tl.constexpr):
    # K <= KP, a runtime value: one compiled variant per power of two
    i = tl.program_id(0)
    base = RAW + i.to(tl.int64) * stride
    slots = tl.arange(0, KP)
    # padding slots hold +inf: never the minimum a new value replaces
    top_v = tl.where(slots < K, float("-inf"), float("inf")).to(tl.float32)
    top_i = tl.zeros([KP], tl.int32)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max (a scalar)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # sum of exp(x - m)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, 0)
        new_m = tl.maximum(m, chunk_max)
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: nothing to add
        s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), 0)
        m = new_m
        if K > 0:
            # The chunk's best values replace the smallest kept ones while they beat them (on
            # random logits most chunks beat none: one comparison).
            y = x
            v = chunk_max
            lo = tl.min(top_v, 0)
            for _ in tl.static_range(KP):
                if v > lo:
                    j = tl.min(tl.where(y == v, cols, vocab), 0)  # first index of the maximum
                    at = tl.min(tl.where(top_v == lo, slots, KP), 0)
                    top_v = tl.where(slots == at, v, top_v)
                    top_i = tl.where(slots == at, j, top_i)
                    y = tl.where(cols == j, float("-inf"), y)
                    v = tl.max(y, 0)
                    lo = tl.min(top_v, 0)
    lse = tl.where(m == float("-inf"), m, m + tl.log(s))
    row = OUT + i.to(tl.int64) * out_stride
    sampled = tl.load(IDS + i)
    tl.store(row, sampled.to(tl.float32))
    token = tl.minimum(tl.maximum(sampled, 0), vocab - 1)  # MASKED rows: any id's logprob
    tl.store(row + 1, tl.load(base + token).to(tl.float32) - lse)
    for r in tl.static_range(KP):  # the k slots, best first
        if r < K:
            live = tl.where(slots < K, top_v, float("-inf"))
            v = tl.max(live, 0)
            at = tl.min(tl.where((live == v) & (slots < K), slots, KP), 0)
            tl.store(row + 2 + r, v - lse)
            tl.store(row + 2 + K + r, tl.sum(tl.where(slots == at, top_i, 0), 0).to(tl.float32))
            top_v = tl.where(slots == at, float("-inf"), top_v)
            slots = tl.where(slots == at, KP, slots)  # taken: out of the live slots


def packed_logprobs(raw: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 2 + 2k] float32 of `raw` [n, V] logits (float32, bfloat16 or float16, read as they are
    and computed in float32; unit column stride) and the sampled `ids` [n] (negative: a row that
    could not be sampled, any id's logprob), `k` <= MAX_K."""
    assert raw.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert raw.stride(1) == 1 and 0 <= k <= MAX_K
    n, vocab = raw.shape
    out = torch.empty(n, 2 + 2 * k, dtype=torch.float32, device=raw.device)
    if n:
        _packed_logprobs_kernel[(n,)](
            raw, ids, out, vocab, raw.stride(0), out.stride(0),
            k, KP=max(triton.next_power_of_2(k), 2), BLOCK=_BLOCK, num_warps=8)
    return out
