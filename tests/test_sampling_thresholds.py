"""Top-k / top-p / min-p floors (lmnb/runtime/sampling/thresholds.py): the radix-select kernel
gives the torch reference's floors (fp32, bf16 and fp16 rows, ties, masked and NaN rows, a padded
stride), the kept set {x >= floor} is the sort-based filter chain's (ties at the floor all kept),
draws through the kernel follow the renormalised nucleus, and the kernel compiles for sm_90."""

import pytest
import torch

from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import Sampler, race, sampler, thresholds
from lmnb.runtime.sampling.batch_info import RowGroup
from lmnb.runtime.scheduler import ReqState

pytestmark = SAME_TRITON_MODE

_SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0), (0.7, -1, 0.9, 0.0), (1.3, 40, 0.8, 0.0), (0.5, -1, 0.3, 0.1),
    (1.0, 1, 1.0, 0.0), (2.0, 200, 0.95, 0.02), (1.0, -1, 0.999, 0.0), (0.9, 3, 0.5, 0.3),
]


def _group(settings: list[tuple[float, int, float, float]], vocab: int, batch: int,
           positions: list[int], device: str) -> RowGroup:
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    return RowGroup(positions, params, vocab, batch, torch.device(device))


def sort_based_kept(x: torch.Tensor, temperature: float, k: int, p: float,
                    min_p: float) -> set[int]:
    """The filter chain on one row by sorting (HF's warpers' rule): the k best, then the best
    whose mass ranked strictly above them (renormalised over the k) is < p, then min-p."""
    order = torch.argsort(x.double(), descending=True, stable=True)
    if k > 0:
        order = order[:k]
    probs = torch.softmax(x.double()[order] / temperature, -1)
    before = probs.cumsum(-1) - probs
    kept = order[(before < p) | (p >= 1.0)]
    full = torch.softmax(x.double() / temperature, -1)
    return {t for t in kept.tolist() if full[t] >= min_p * full.max()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_floors_are_the_references(device: str, dtype: torch.dtype) -> None:
    """Random rows in three dtypes (bf16 / fp16 rows hold many tied logits): the kernel's floors
    are the torch reference's, bit for bit for top-k and min-p and to a mass rounding for top-p;
    rows with -inf tokens, an all -inf row and a NaN row give no error (the race gives them their
    verdicts); a padded row stride and a vocabulary not a multiple of the block."""
    vocab, batch = 700, 11
    wide = torch.randn(batch, vocab + 5, generator=torch.Generator().manual_seed(3)) * 3
    logits = wide.to(dtype)[:, :vocab]
    logits[2, :300] = float("-inf")
    logits[9, :] = float("-inf")
    logits[10, 7] = float("nan")
    positions = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    settings = _SETTINGS + [(0.8, 2, 1.0, 0.0), (1.0, -1, 0.5, 0.0), (1.0, 10, 0.7, 0.0)]
    group = _group(settings, vocab, batch, positions, device)
    got = thresholds.cut_floors(logits.to(device), group, block=512).cpu()
    expected = thresholds.reference_floors(logits, _group(settings, vocab, batch, positions,
                                                          "cpu"))
    assert got[:9].tolist() == expected[:9].tolist()
    assert got[9].item() == float("-inf") and expected[9].item() == float("-inf")
    for row, (_, k, p, m) in enumerate(settings[:9]):  # top-k alone keeps k or more (ties)
        kept = int((logits[row].float() >= got[row]).sum())
        assert kept >= (k if p == 1.0 and m == 0.0 else 1)
    subset = _group(settings[3:5], vocab, batch, [4, 3], device)  # some rows, any order
    assert thresholds.cut_floors(logits.to(device), subset).cpu().tolist() == [
        expected[4].item(), expected[3].item()]


@pytest.mark.parametrize("device", DEVICES)
def test_kept_set_is_the_sort_based_filter_chain(device: str) -> None:
    """On rows without ties (distinct fp32 logits) {x >= floor} is exactly the set the sort-based
    chain keeps (top-k, top-p renormalised over it, min-p); with ties at the k-th logit every tied
    token is kept."""
    vocab = 2000
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(_SETTINGS), vocab, generator=gen) * torch.tensor(
        [[3.0], [1.0], [0.2], [4.0], [2.0], [1.0], [0.5], [3.0]])
    assert all(len(set(row.tolist())) == vocab for row in logits)
    positions = list(range(len(_SETTINGS)))
    group = _group(_SETTINGS, vocab, len(_SETTINGS), positions, device)
    floors = thresholds.cut_floors(logits.to(device), group).cpu()
    for row, (t, k, p, m) in enumerate(_SETTINGS):
        kept = set((logits[row] >= floors[row]).nonzero().flatten().tolist())
        assert kept == sort_based_kept(logits[row], t, k, p, m), row
    tied = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0, 3.0, -1.0]])
    tie_group = _group([(1.0, 2, 1.0, 0.0)], 8, 1, [0], device)
    floor = thresholds.cut_floors(tied.to(device), tie_group).cpu()
    reference = thresholds.reference_floors(tied.to(device), tie_group).cpu()
    assert floor.tolist() == [3.0] == reference.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_draws_above_the_kernels_floor_follow_the_renormalised_nucleus(device: str) -> None:
    """The race above the kernel's floor (one draw per seed) draws each token of the nucleus with
    its renormalised probability (chi-square) and no token outside it; the sampler's
    `distribution` through the kernel is that renormalised nucleus."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    group = _group([(1.3, 6, 0.8, 0.0)], 8, 1, [0], device)
    floor = thresholds.cut_floors(base[None].to(device), group).cpu()
    kept = sort_based_kept(base, 1.3, 6, 0.8, 0.0)
    assert set((base >= floor).nonzero().flatten().tolist()) == kept
    target = torch.zeros(8, dtype=torch.float64)
    target[sorted(kept)] = torch.softmax(base.double()[sorted(kept)] / 1.3, -1)
    rows = [ReqState(Req(origin_input_ids=[1], sampling_params=SamplingParams(
        temperature=1.3, top_k=6, top_p=0.8)))]
    sampling = Sampler(8, {7})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "KERNEL_DEVICES", (device,))
        probs = sampling.distribution(base[None].to(device), sampling.batch_info(rows, device))
    torch.testing.assert_close(probs.cpu().double()[0], target, atol=1e-6, rtol=0)
    draws = 20000
    ids = race.race_logits(base.expand(draws, 8), torch.arange(draws), torch.full((draws, 1), 1.3),
                           floor.expand(draws, 1), torch.arange(draws) * 7919 + 1)
    observed = torch.bincount(ids, minlength=8).double()
    assert observed[target == 0].sum() == 0
    expected = target[target > 0] * draws
    chi2 = float(((observed[target > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom (4 kept tokens), p = 0.001


@pytest.mark.parametrize("device", DEVICES)
def test_sliced_rows_give_the_one_slice_floors(device: str) -> None:
    """Rows cut into several slices (uneven: the last one short), skipping blocks with no token
    under a pass's prefix, give the floors of one slice per row without skipping (the
    one-program kernel) and the torch reference's, on bf16 rows (many ties): top-k and min-p
    bit for bit (counts and maxima are exact), top-p too on these rows (its float bucket sums are
    only reordered)."""
    vocab, batch = 700, 9  # 11 blocks of 64: slices of 192 tokens, the last of 124
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).bfloat16()
    logits[2, 570:] = float("-inf")  # the last slice of a row holds no finite logit
    settings = _SETTINGS + [(1.0, 600, 0.99, 0.0)]
    positions = list(range(batch))
    group = _group(settings, vocab, batch, positions, device)
    sliced = thresholds.cut_floors(logits.to(device), group, block=64, splits=4).cpu()
    whole = thresholds.cut_floors(logits.to(device), group, block=64, splits=1,
                                  skip=False).cpu()
    expected = thresholds.reference_floors(logits, _group(settings, vocab, batch, positions,
                                                          "cpu"))
    assert sliced.tolist() == whole.tolist() == expected.tolist()


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmnb.runtime.sampling import thresholds as th
target = GPUTarget("cuda", 90, 32)
state = {"PARTS": "*fp32", "PREFIXES": "*i32", "ABOVES": "*fp32", "TARGETS": "*fp32"}
for mass in (False, True):
    signature = {"LOGITS": "*bf16", "ROWS": "*i64", "TEMPS": "*fp32", "TOP_KS": "*i64",
                 "TOP_PS": "*fp32", "FLOORS": "*fp32", "BESTS": "*fp32",
                 **{name + "_IN": kind for name, kind in state.items()}, **state,
                 "vocab": "i32", "stride": "i32", "chunk": "i32", "shift": "i32"}
    signature.update(dict.fromkeys(("MASS", "FIRST", "SECOND", "BLOCK", "SPLITS",
                                    "SKIP"), "constexpr"))
    for first, second in ((True, False), (False, True), (False, False)):
        triton.compile(ASTSource(fn=th._digits_kernel, signature=signature, constexprs={
            "MASS": mass, "FIRST": first, "SECOND": second, "BLOCK": th.BLOCK,
            "SPLITS": 16, "SKIP": not first}), target=target, options={"num_warps": th.WARPS})
    signature = {"TOP_KS": "*i64", "TOP_PS": "*fp32", **state, "FLOORS": "*fp32",
                 "vocab": "i32", "splits": "i32", "MASS": "constexpr", "PASSES": "constexpr",
                 "SPLITS": "constexpr"}
    triton.compile(ASTSource(fn=th._last_kernel, signature=signature, constexprs={
        "MASS": mass, "PASSES": 4, "SPLITS": 16}), target=target, options={"num_warps": 1})
signature = {"LOGITS": "*bf16", "ROWS": "*i64", "TOP_PS": "*fp32", "MIN_PS": "*fp32",
             "BESTS": "*fp32", "vocab": "i32", "stride": "i32", "chunk": "i32",
             "BLOCK": "constexpr"}
triton.compile(ASTSource(fn=th._max_kernel, signature=signature, constexprs={
    "BLOCK": th.BLOCK}), target=target, options={"num_warps": th.WARPS})
signature = {"TEMPS": "*fp32", "MIN_PS": "*fp32", "BESTS": "*fp32", "FLOORS": "*fp32",
             "splits": "i32", "SPLITS": "constexpr"}
triton.compile(ASTSource(fn=th._finish_kernel, signature=signature, constexprs={
    "SPLITS": 16}), target=target, options={"num_warps": 1})
print("compiled")
"""


def test_floors_kernels_compile_for_a_hopper_gpu() -> None:
    assert_compiles_for_sm90(_COMPILE)
