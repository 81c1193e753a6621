"""The exponential race (lmnb/runtime/sampling/race.py): the Triton kernel draws exactly the torch
version's tokens (same noise), in the interpreter on CPU and compiled on CUDA; frequencies follow
softmax(logits / T) restricted by min-p; the kernel compiles for sm_90."""

import pytest
import torch

from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.sampling import race

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
    got = race.race_logits_triton(logits, rows, temps, floors, seeds)
    x = logits[rows].cpu()
    scores = x / temps.cpu() + race.gumbel_noise(seeds.cpu()[:, None], torch.arange(2500)[None])
    expected = scores.masked_fill(x < floors.cpu(), float("-inf")).argmax(-1)
    assert got.cpu().tolist() == expected.tolist()
    assert got[3] == 7 and got[1] >= 300
    assert bool((x.gather(1, got.cpu()[:, None]) >= floors.cpu()).all())
    other = race.race_logits_triton(logits, rows, temps, floors, seeds + 1)
    assert other.cpu().tolist() != got.cpu().tolist()
    for splits in (1, 2, 3):  # the vocabulary raced in slices (the last one short): same draw
        sliced = race.race_logits_triton(logits, rows, temps, floors, seeds, splits=splits)
        assert sliced.cpu().tolist() == expected.tolist()


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
signature = {"LOGITS": "*fp32", "ROWS": "*i64", "TEMPS": "*fp32", "FLOORS": "*fp32",
             "SEEDS": "*i64", "BEST": "*fp32", "BEST_ID": "*i32", "vocab": "i32", "stride": "i32",
             "chunk": "i32", "BLOCK": "constexpr"}
triton.compile(ASTSource(fn=race._race_logits_kernel, signature=signature,
                         constexprs={"BLOCK": 1024}),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""


def test_race_kernel_compiles_for_a_hopper_gpu() -> None:
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
