"""The batch sampler on a CUDA device: a step (penalties, min_new_tokens, grammar bitmask, top-k/p,
min-p, seeded rows, logprobs) and its `advance` issue no host sync; greedy agrees with the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import Sampler, pack_mask
from lmnb.runtime.scheduler import ReqState

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EOS = 2
VOCAB = 32000


def _reqs(bs: int, device: str) -> list[ReqState]:
    reqs = []
    for i in range(bs):
        req = Req(origin_input_ids=list(range(i, i + 50)), return_logprob=True,
                  top_logprobs_num=i % 3, sampling_params=SamplingParams(
                      temperature=[0.0, 0.7, 1.0][i % 3], top_p=[1.0, 0.9][i % 2],
                      top_k=[-1, 20, -1, 100][i % 4], min_p=[0.0, 0.05][i % 5 == 0],
                      repetition_penalty=[1.0, 1.1][i % 6 == 0],
                      frequency_penalty=[0.0, 0.2][i % 4 == 1], min_new_tokens=i % 3,
                      stop_token_ids=[7]))
        req.output_ids = list(range(i % 7))
        state = ReqState(req)
        if i % 8 == 0:
            state.generator = torch.Generator(device=device).manual_seed(i)
        reqs.append(state)
    return reqs


def test_a_step_issues_no_host_sync() -> None:
    torch.manual_seed(0)
    bs = 64
    reqs = _reqs(bs, "cuda")
    sampler = Sampler(VOCAB, {EOS})
    info = sampler.batch_info(reqs, "cuda")
    allowed = torch.rand(bs, VOCAB, device="cuda") < 0.5
    bitmask = pack_mask(allowed)
    for step in range(3):  # the first step warms the allocators up
        logits = torch.randn(bs, VOCAB, device="cuda") * 3
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampler(logits, info, bitmask)
            info.advance(out.next_token_ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ids = out.token_ids()
        copies = out.host_copies()  # every row asked: the packed copy brings the ids too
        assert len(copies) == 1 and all(copy.is_pinned() for copy in copies)
        assert all(bool(allowed[row, token]) for row, token in enumerate(ids))
        for req, token in zip(reqs, ids, strict=True):
            req.output_ids.append(token)
        assert info.matches(reqs)
        tops = out.top_logprobs()
        assert tops is not None and [len(t) for t in tops] == [i % 3 for i in range(bs)]


def test_greedy_and_adjusted_logits_agree_with_the_cpu() -> None:
    torch.manual_seed(1)
    bs = 16
    logits = torch.randn(bs, VOCAB) * 3
    sampler = Sampler(VOCAB, {EOS})
    results = {}
    for device in ("cpu", "cuda"):
        reqs = _reqs(bs, device)
        for req in reqs:
            req.sampling_params.temperature = 0.0
        info = sampler.batch_info(reqs, device)
        results[device] = (sampler(logits.to(device), info).token_ids(),
                           sampler.adjusted_logits(logits.to(device), info).cpu())
    assert results["cpu"][0] == results["cuda"][0]
    torch.testing.assert_close(results["cpu"][1], results["cuda"][1])


@pytest.mark.parametrize("top", [0, 5, 20])  # 20: wider than the kernel keeps (torch's topk)
def test_logprobs_and_top_logprobs_agree_with_the_cpu(top: int) -> None:
    """On CUDA the packed logprobs come from one Triton launch (up to MAX_K) or torch ops; the
    CPU's torch ops give the same ids and logprobs to float rounding."""
    torch.manual_seed(2)
    bs = 8
    logits = torch.randn(bs, VOCAB) * 3
    sampler = Sampler(VOCAB, {EOS})
    results = {}
    for device in ("cpu", "cuda"):
        reqs = _reqs(bs, device)
        for req in reqs:
            req.sampling_params.temperature = 0.0
            req.req.top_logprobs_num = top
        out = sampler(logits.to(device), sampler.batch_info(reqs, device))
        results[device] = (out.token_ids(), out.logprobs(), out.top_logprobs())
    cpu, cuda = results["cpu"], results["cuda"]
    assert cpu[0] == cuda[0]
    torch.testing.assert_close(torch.tensor(cuda[1]), torch.tensor(cpu[1]), atol=1e-5, rtol=0)
    if top:
        assert [[t for _, t in row] for row in cuda[2]] == [[t for _, t in row] for row in cpu[2]]
        torch.testing.assert_close(torch.tensor([[v for v, _ in row] for row in cuda[2]]),
                                   torch.tensor([[v for v, _ in row] for row in cpu[2]]),
                                   atol=1e-5, rtol=0)
    else:
        assert cuda[2] is None and cpu[2] is None


LLAMA3_VOCAB = 128256


@pytest.mark.parametrize("mixed", [False, True])  # False: the offline workload's rows (T 0.6)
def test_bf16_logits_sample_as_their_fp32_upcast(mixed: bool, monkeypatch) -> None:
    """bf16 logits at Llama-3's vocabulary (what `compute_logits` returns, rows padded wider than
    the vocabulary): through `race.sample_rows` (one read of each row, compiled) the same ids as
    their fp32 upcast and as the torch path, verdicts of NaN / all -inf rows included, logprobs
    the upcast's exactly, and no host sync."""
    from lmnb.runtime.sampling import sampler as sampler_module

    bs = 64

    def rows() -> list[ReqState]:  # fresh: the seeded rows' generators start over
        reqs = _reqs(bs, "cuda")
        for i, req in enumerate(reqs):
            req.req.top_logprobs_num = i % 3
            if not mixed:
                req.req.sampling_params = SamplingParams(temperature=0.6)
        return reqs

    sampler = Sampler(LLAMA3_VOCAB, {EOS})
    torch.manual_seed(3)
    logits = (torch.randn(bs, LLAMA3_VOCAB + 64, device="cuda") * 3).bfloat16()
    logits[5, 1000] = float("nan")
    logits[9, :] = float("-inf")
    results = {}
    for kernel in (True, False):
        monkeypatch.setattr(sampler_module, "KERNEL_DEVICES", ("cuda",) if kernel else ())
        for dtype in (torch.bfloat16, torch.float32):
            x = logits.to(dtype)
            sampler(x, sampler.batch_info(rows(), "cuda"))  # warm-up (allocator, kernels)
            info = sampler.batch_info(rows(), "cuda")
            torch.manual_seed(4)  # the unseeded rows' seeds
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = sampler(x, info)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            results[kernel, dtype] = (out.next_token_ids.cpu(), out.packed_logprobs.cpu())
    ids, packed = results[True, torch.bfloat16]
    assert ids[5] == -2 and ids[9] == -1 and int((ids < 0).sum()) == 2
    reqs = rows()
    adjusted = sampler.adjusted_logits(logits, sampler.batch_info(reqs, "cuda"))
    for row, req in enumerate(reqs):
        if req.sampling_params.temperature == 0.0 and row != 9:
            assert ids[row] == adjusted[row].argmax()
    for (kernel, dtype), (got_ids, got_packed) in results.items():
        assert torch.equal(got_ids, ids), (kernel, dtype)
        exact = 0 if kernel else 1e-5  # torch's log_softmax may reduce bf16 in another order
        torch.testing.assert_close(got_packed, results[kernel, torch.float32][1], atol=exact,
                                   rtol=0, equal_nan=True)


def _sorted_floor(x: torch.Tensor, temperature: float, k: int, p: float) -> float:
    """The sort-based chain's floor on one row in float64 (top-k, then top-p renormalised over
    the k best: the smallest kept logit), ties with the k-th logit in the top-k set."""
    values = x.double().sort(descending=True).values
    if k > 0:
        values = values[values >= values[k - 1]]
    probs = torch.softmax(values / temperature, -1)
    before = probs.cumsum(-1) - probs
    return float(values[(before < p) | (p >= 1.0)].min())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cut_floors_at_llama3_vocabulary_are_the_sort_based_ones(dtype: torch.dtype) -> None:
    """The radix-select kernel at 128,256 tokens, compiled: top-k floors are the k-th logit
    exactly (torch's topk), min-p's best + T log(min_p), top-p's kept set is the float64
    sort-based nucleus (ties at the edge all kept) unless the nucleus' mass lies within float
    rounding of top_p, and the floors are the torch reference's and (top-p edges aside) those
    of one program per row."""
    from lmnb.runtime.sampling import thresholds
    from lmnb.runtime.sampling.batch_info import RowGroup

    settings = [(0.6, -1, 0.9), (1.0, 50, 1.0), (0.6, 50, 0.9), (1.0, -1, 0.5), (0.8, 1, 1.0),
                (1.3, 1000, 0.95), (0.6, -1, 0.99), (2.0, 20, 0.3)] * 4
    n = len(settings)
    torch.manual_seed(7)
    scale = torch.tensor([0.5, 1.0, 3.0, 6.0] * (n // 4), device="cuda")[:, None]
    logits = (torch.randn(n, LLAMA3_VOCAB + 64, device="cuda") * scale).to(dtype)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=0.02 * (i % 3 == 0))
              for i, (t, k, p) in enumerate(settings)]
    group = RowGroup(list(range(n)), params, LLAMA3_VOCAB, n, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        floors = thresholds.cut_floors(logits, group)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    whole = thresholds.cut_floors(logits, group, splits=1, skip=False).cpu()  # as one kernel
    exact = [row for row, (_, _, p) in enumerate(settings) if p >= 1.0]  # counts and maxima
    assert torch.equal(whole[exact], floors.cpu()[exact])
    assert int((whole != floors.cpu()).sum()) <= 2  # top-p sums reordered: edges at most
    x = logits[:, :LLAMA3_VOCAB].float().cpu()
    reference = thresholds.reference_floors(x, RowGroup(list(range(n)), params, LLAMA3_VOCAB, n,
                                                        torch.device("cpu")))
    floors = floors.cpu()
    edges = 0
    for row, ((t, k, p), param) in enumerate(zip(settings, params, strict=True)):
        expected = _sorted_floor(x[row], t, k, p)
        if param.min_p > 0:
            expected = max(expected, float(x[row].max()) + t * math.log(param.min_p))
        kept, sort_kept = x[row] >= floors[row], x[row] >= expected
        assert torch.equal(kept, x[row] >= reference[row]) or p < 1.0, row
        if not torch.equal(kept, sort_kept):  # top-p's mass within float rounding of top_p
            assert p < 1.0, (row, float(floors[row]), expected)
            probs = torch.softmax(x[row].double() / t, -1)
            if k > 0:
                probs = probs.masked_fill(x[row] < x[row].topk(k).values[-1], 0.0)
            masses = [float(probs[s].sum() / probs.sum()) for s in (kept, sort_kept)]
            assert min(abs(m - p) for m in masses) < 2e-6, (row, masses)
            edges += 1
    assert edges <= 2


def test_top_p_and_top_k_draws_follow_the_renormalised_nucleus() -> None:
    """Rows of one bf16 logit vector at Llama-3's vocabulary, sampled through the GPU path
    (floors, then the race): the frequencies of the nucleus' tokens follow its renormalised
    probabilities (chi-square), nothing outside it is drawn, and `distribution` is that
    renormalised nucleus."""
    torch.manual_seed(8)
    base = torch.randn(LLAMA3_VOCAB) - 10.0
    base[[11, 5000, 70000, 128000, 42, 99]] = torch.tensor([8.0, 7.5, 7.0, 6.5, 6.0, 5.5])
    base = base.bfloat16().float()
    draws, sampler = 2048, Sampler(LLAMA3_VOCAB, {EOS})
    for params in (dict(top_p=0.9), dict(top_k=50, top_p=0.9), dict(top_k=3)):
        rows = [ReqState(Req(origin_input_ids=[1], sampling_params=SamplingParams(
            temperature=1.0, **params))) for _ in range(draws)]
        k, p = params.get("top_k", -1), params.get("top_p", 1.0)
        kept = base >= _sorted_floor(base, 1.0, k, p)
        target = torch.softmax(base.double(), -1).masked_fill(~kept, 0.0)
        target = target / target.sum()
        info = sampler.batch_info(rows, "cuda")
        logits = base.bfloat16().cuda().expand(draws, LLAMA3_VOCAB)
        got = sampler.distribution(logits[:1], sampler.batch_info(rows[:1], "cuda"))[0].cpu()
        torch.testing.assert_close(got.double(), target, atol=1e-6, rtol=0)
        counts = torch.zeros(LLAMA3_VOCAB, dtype=torch.float64)
        for _ in range(4):
            ids = sampler(logits, info).next_token_ids.cpu()
            counts += torch.bincount(ids, minlength=LLAMA3_VOCAB).double()
        assert counts[~kept].sum() == 0, params
        expected = target[kept] * counts.sum()
        chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
        assert int(kept.sum()) in (3, 4) and chi2 < 16.3, (params, chi2)  # <= 3 dof, p 0.001
