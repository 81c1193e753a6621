"""The exponential race (lmnb/runtime/sampling/race.py): the Triton kernels draw exactly the torch
version's tokens (same noise) and give greedy rows their first maximal logit and every row its
verdict (MASKED / NOT_FINITE), reading fp32 or bf16 rows, in the interpreter on CPU and compiled on
CUDA; frequencies follow softmax(logits / T) restricted by min-p; the kernels compile for sm_90."""

import pytest
import torch

from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import Sampler, race, sampler
from lmnb.runtime.sampling.output import MASKED, NOT_FINITE
from lmnb.runtime.scheduler import ReqState

pytestmark = SAME_TRITON_MODE


def _batch(device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2500, generator=gen) * 3
    logits[1, :300] = float("-inf")  # masked tokens never win
    logits[4, 7] = 40.0  # a dominant token
    rows = torch.tensor([0, 1, 3, 4, 5])
    temps = torch.tensor([[0.7], [1.0], [1.5], [0.3], [2.0]])
    floors = torch.tensor([[float("-inf")], [float("-inf")], [0.5], [float("-inf")], [2.0]])
    seeds = torch.tensor([5, race.SEED_BOUND - 1, 123456, 0, 77])
    return tuple(t.to(device) for t in (logits, rows, temps, floors, seeds))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_draws_the_torch_versions_tokens(device: str) -> None:
    logits, rows, temps, floors, seeds = _batch(device)
    temps, floors = temps[:, 0], floors[:, 0]
    got = race.sample_rows(logits, rows, temps, floors, seeds)
    x = logits[rows].cpu()
    scores = (x / temps.cpu()[:, None]
              + race.gumbel_noise(seeds.cpu()[:, None], torch.arange(2500)[None]))
    expected = scores.masked_fill(x < floors.cpu()[:, None], float("-inf")).argmax(-1)
    assert got.cpu().tolist() == expected.tolist()
    assert got[3] == 7 and got[1] >= 300
    assert bool((x.gather(1, got.cpu()[:, None]) >= floors.cpu()[:, None]).all())
    other = race.sample_rows(logits, rows, temps, floors, seeds + 1)
    assert other.cpu().tolist() != got.cpu().tolist()
    for splits in (1, 2, 3):  # the vocabulary raced in slices (the last one short): same draw
        sliced = race.sample_rows(logits, rows, temps, floors, seeds, splits=splits)
        assert sliced.cpu().tolist() == expected.tolist()


def _reference(logits: torch.Tensor, temps: torch.Tensor, floors: torch.Tensor,
               seeds: torch.Tensor) -> list[int]:
    """The sampler's torch path: first maximal logit or the race, then the verdicts."""
    x = logits.float()
    best, ids = x.max(dim=-1)
    rows = (temps > 0).nonzero().flatten()
    ids[rows] = race.race_logits(x, rows, temps[rows, None], floors[rows, None], seeds[rows])
    bad = ~torch.isfinite(best)
    return ids.masked_fill(bad, MASKED).masked_fill(bad & (best != float("-inf")),
                                                    NOT_FINITE).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_and_verdicts_in_the_same_read(device: str, dtype: torch.dtype) -> None:
    """Greedy rows (temperature 0) get their first maximal logit, ties across slices included;
    rows whose best is -inf are MASKED, rows holding NaN or +inf NOT_FINITE, whether they race
    or not; bf16 rows read as they are give the draws of their fp32 upcast; a padded row stride
    (logits wider than the vocabulary) and a vocabulary not a multiple of the block."""
    vocab = 2500
    gen = torch.Generator().manual_seed(1)
    wide = (torch.randn(12, vocab + 6, generator=gen) * 3).to(dtype)
    logits = wide[:, :vocab]
    logits[0, [2400, 1114, 90, 1500]] = 20.0  # greedy: a tie within a lane and across slices
    logits[1, :] = float("-inf")  # greedy, MASKED
    logits[2, :] = float("-inf")  # racing, MASKED
    logits[3, 2499] = float("nan")  # greedy, NOT_FINITE (the last column)
    logits[4, 1030] = float("nan")  # racing, NOT_FINITE
    logits[5, 7] = float("inf")  # greedy, NOT_FINITE
    logits[6, 2000] = float("inf")  # racing, NOT_FINITE
    logits[7, :2000] = float("-inf")  # racing in the last slice only
    logits[8, 1024] = 30.0  # racing: a dominant token at a block's first column
    logits[9, :] = float("-inf")
    logits[9, 2] = float("nan")  # NaN beside -inf: NOT_FINITE
    temps = torch.tensor([0.0, 0.0, 0.8, 0.0, 1.2, 0.0, 0.7, 1.0, 0.5, 0.0, 0.9, 0.0])
    floors = torch.full((12,), float("-inf"))
    floors[10] = 1.0  # min-p's floor on a racing row
    seeds = torch.arange(12) * 7919 + 3
    expected = _reference(logits, temps, floors, seeds)
    assert expected[:7] == [90, MASKED, MASKED, NOT_FINITE, NOT_FINITE, NOT_FINITE, NOT_FINITE]
    assert expected[7] >= 2000 and expected[8:10] == [1024, NOT_FINITE]
    rows = torch.arange(12)
    args = [t.to(device) for t in (logits, rows, temps, floors, seeds)]
    for splits in (1, 3):  # 3: one block per slice, the tie's columns in three slices
        got = race.sample_rows(*args, splits=splits)
        assert got.dtype == torch.int64 and got.cpu().tolist() == expected, splits
    subset = torch.tensor([11, 0, 8]).to(device)  # some rows, in any order
    got = race.sample_rows(args[0], subset, *(t[subset] for t in args[2:]))
    assert got.cpu().tolist() == [expected[11], expected[0], expected[8]]
    all_greedy = _reference(logits, torch.zeros(12), floors, seeds)
    assert all_greedy[:10] == [*expected[:7], all_greedy[7], 1024, NOT_FINITE]
    for splits in (None, 1, 3):  # `greedy_rows`: the kernels without the race, rows 0..n-1
        got = race.greedy_rows(args[0], splits=splits)
        assert got.dtype == torch.int64 and got.cpu().tolist() == all_greedy, splits


def _rows(device: str, repetition: float) -> list[ReqState]:
    params = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, min_p=0.1),
              dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9),
              dict(temperature=1.2), dict(temperature=0.9, top_k=5), dict(temperature=0.0)]
    rows = []
    for i, p in enumerate(params):
        req = Req(origin_input_ids=[3, 4, 5 + i], return_logprob=i % 2 == 0,
                  top_logprobs_num=i % 3, sampling_params=SamplingParams(
                      repetition_penalty=repetition if i == 1 else 1.0, **p))
        state = ReqState(req)
        if i == 5:
            state.generator = torch.Generator(device=device).manual_seed(11)
        rows.append(state)
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("repetition", [1.0, 1.3])  # 1.3: the adjusted fp32 copy path
def test_sampler_through_the_kernel_draws_the_torch_paths_tokens(device: str, repetition: float,
                                                                 monkeypatch) -> None:
    """A batch of greedy, temperature, min-p, top-k, top-p and seeded rows, one of them NaN and
    one (top-k) all -inf: through `race.sample_rows` and through torch ops, from bf16 logits and
    from their fp32 upcast, the same ids, verdicts and logprobs (bf16 against its upcast: the very
    same, upcasting is exact)."""
    vocab = 3000
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    logits[2, 40] = float("nan")
    logits[6, :] = float("-inf")
    results = {}
    for kernel in (False, True):
        monkeypatch.setattr(sampler, "KERNEL_DEVICES", (device,) if kernel else ())
        for dtype in (torch.bfloat16, torch.float32):
            rows = _rows(device, repetition)
            sampling = Sampler(vocab, {2})
            torch.manual_seed(5)  # the unseeded rows' seeds
            out = sampling(logits.to(device, dtype), sampling.batch_info(rows, device))
            results[kernel, dtype] = (out.next_token_ids.cpu(), out.packed_logprobs.cpu())
    ids, packed = results[False, torch.float32]
    assert ids[2] == NOT_FINITE and ids[6] == MASKED and bool((ids[[0, 1, 3, 4, 5, 7]] >= 0).all())
    assert ids[0] == logits[0].float().argmax() and ids[7] == logits[7].float().argmax()
    sound = [0, 1, 3, 4, 6]  # the packed rows (rows 0-2, 4, 5-7 ask) of the rows sampled
    for (kernel, dtype), (got_ids, got_packed) in results.items():
        assert torch.equal(got_ids, ids), (kernel, dtype)
        torch.testing.assert_close(got_packed, results[kernel, torch.float32][1], atol=0, rtol=0,
                                   equal_nan=True)
        torch.testing.assert_close(got_packed[sound], packed[sound], atol=2e-5, rtol=0)


def test_frequencies_follow_softmax_within_min_p() -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    draws, temperature = 20000, 0.8
    floor = float(base.max()) + temperature * torch.log(torch.tensor(0.1))
    seeds = torch.randint(race.SEED_BOUND, (draws,), generator=torch.Generator().manual_seed(4))
    ids = race.race_logits(base.expand(draws, 8).contiguous(), torch.arange(draws),
                           torch.full((draws, 1), temperature),
                           torch.full((draws, 1), float(floor)), seeds)
    observed = torch.bincount(ids, minlength=8).double()
    kept = base >= floor
    assert observed[~kept].sum() == 0
    target = torch.softmax((base / temperature).masked_fill(~kept, float("-inf")).double(), -1)
    expected = target[kept] * draws
    chi2 = float(((observed[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 22.5  # at most 6 degrees of freedom, p = 0.001


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmnb.runtime.sampling import race
for logits, greedy in (("*fp32", False), ("*bf16", False), ("*bf16", True)):
    signature = {"LOGITS": logits, "ROWS": "*i64", "TEMPS": "*fp32", "FLOORS": "*fp32",
                 "SEEDS": "*i64", "TOP": "*fp32", "TOP_ID": "*i32", "BEST": "*fp32",
                 "BEST_ID": "*i32", "vocab": "i32", "stride": "i32", "chunk": "i32",
                 "BLOCK": "constexpr", "GREEDY": "constexpr"}
    triton.compile(ASTSource(fn=race._sample_rows_kernel, signature=signature,
                             constexprs={"BLOCK": race.BLOCK, "GREEDY": greedy}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
for greedy in (False, True):
    signature = {"TOP": "*fp32", "TOP_ID": "*i32", "BEST": "*fp32", "BEST_ID": "*i32",
                 "TEMPS": "*fp32", "IDS": "*i64", "n": "i32", "splits": "i32",
                 "ROWS": "constexpr", "SPLITS": "constexpr", "GREEDY": "constexpr"}
    triton.compile(ASTSource(fn=race._pick_kernel, signature=signature,
                             constexprs={"ROWS": 64, "SPLITS": 8, "GREEDY": greedy}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""


def test_race_kernels_compile_for_a_hopper_gpu() -> None:
    assert_compiles_for_sm90(_COMPILE)


def test_noise_is_finite_at_the_extremes_of_the_hash() -> None:
    """The largest and smallest hash values give finite noise (a uniform of 1.0 would give +inf,
    and a masked token's -inf + inf = NaN, which argmax picks)."""
    columns = torch.arange(1 << 16)[None, :]
    seeds = torch.arange(64)[:, None] * 2654435761 % race.SEED_BOUND
    noise = race.gumbel_noise(seeds, columns)
    assert bool(torch.isfinite(noise).all())
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 5] = 0.0
    for seed in range(200):
        assert int(race.race_logits(logits, torch.tensor([0]), torch.ones(1, 1),
                                    torch.full((1, 1), float("-inf")),
                                    torch.tensor([seed]))[0]) == 5
