"""Drawing tokens by the exponential race (the Gumbel-max trick): a row with unnormalised weights w
draws argmax_i w_i / E_i with E_i ~ Exp(1) i.i.d., which picks token i with probability
w_i / sum(w). On logits: argmax_i (x_i / T + G_i), G_i = -log E_i ~ Gumbel(0, 1), so a row sampled
at temperature T over the whole vocabulary needs one read of its logits: no softmax, no cumulative
sum, no normaliser.

The noise is a counter-based hash of (row seed, token id), identical in the torch version and the
Triton kernel: a row's draw depends only on its weights and its seed, so a seeded request's tokens
do not depend on its batch. Seeds are [rows] int64 tensors on the device (`row_seeds`): random
per step, or drawn from a request's own generator.

    race_weights(weights [rows, n], seeds [rows], columns [rows, n]) -> [rows] positions
    race_logits(logits [bs, V], rows [n], temperatures [n, 1], floors [n, 1], seeds [n]) -> [n] ids
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B
SEED_BOUND = 1 << 31


def row_seeds(size: int, generators: list[tuple[int, torch.Generator]],
              device: torch.device) -> torch.Tensor:
    """[size] int64 seeds in [0, 2^31): random from the global generator, rows with their own
    generator (batch row, generator) seeded from it. No host sync."""
    seeds = torch.randint(SEED_BOUND, (size,), device=device)
    for row, generator in generators:
        own = torch.randint(SEED_BOUND, (1,), generator=generator, device=generator.device)
        seeds[row] = own.to(device)[0]
    return seeds


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap mod 2^64, masked)."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise for token ids `columns` of rows with `seeds` ([rows, 1] and [rows, n]
    or [1, n]): the same values as the Triton kernel's."""
    x = _hash32(((columns.to(torch.int64) * _GOLDEN) & _MASK32) ^ seeds.to(torch.int64))
    # 23 bits: (n + 0.5) / 2^23 stays below 1 in float32 (24 bits would round the top to 1.0,
    # whose noise is +inf: a masked token's -inf + inf is NaN, and argmax takes NaN)
    uniform = ((_hash32(x) >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(uniform))


def race_weights(weights: torch.Tensor, seeds: torch.Tensor,
                 columns: torch.Tensor) -> torch.Tensor:
    """[rows] positions drawn from unnormalised `weights` [rows, n] (>= 0, some > 0 per row);
    the noise of position j is that of token `columns[:, j]`."""
    scores = torch.log(weights) + gumbel_noise(seeds[:, None], columns)
    return scores.argmax(dim=-1)


@triton.jit
def _hash32_tl(x):
    """`_hash32` on uint32 lanes (literals >= 2^31 are uint32 in Triton, so products wrap)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _race_logits_kernel(LOGITS, ROWS, TEMPS, FLOORS, SEEDS, BEST, BEST_ID, vocab, stride, chunk,
                        BLOCK: tl.constexpr):
    """Program (i, s) races row ROWS[i]'s tokens s * chunk : (s + 1) * chunk and stores the
    winner's score and id (the smallest id among equal scores) at [i, s]."""
    i = tl.program_id(0)
    part = tl.program_id(1)
    splits = tl.num_programs(1)
    row = tl.load(ROWS + i).to(tl.int64)
    inv_t = 1.0 / tl.load(TEMPS + i)
    floor = tl.load(FLOORS + i)  # logits below it are out of the support (min-p); -inf: none
    seed = tl.load(SEEDS + i).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)  # a row with no finite score draws id 0
    end = tl.minimum((part + 1) * chunk, vocab)
    for start in range(part * chunk, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * stride + cols, mask=cols < end, other=float("-inf"))
        h = _hash32_tl(_hash32_tl((cols.to(tl.uint32) * 0x9E3779B9) ^ seed))
        uniform = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as gumbel_noise
        score = tl.where(x >= floor, x * inv_t - tl.log(-tl.log(uniform)), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, 0)
    tl.store(BEST + i * splits + part, top)
    tl.store(BEST_ID + i * splits + part, tl.min(tl.where(best == top, best_id, vocab), 0))


def race_logits(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                floors: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """[n] token ids: row rows[j] of `logits` [bs, V] (float32) at temperature temperatures[j]
    over the tokens whose logit is >= floors[j] (min-p; -inf: all). One read of each row on a
    GPU (Triton); the torch version elsewhere, with the same noise."""
    if logits.is_cuda:
        return race_logits_triton(logits, rows, temperatures, floors, seeds)
    x = logits[rows]
    columns = torch.arange(x.shape[1], device=x.device)[None, :]
    scores = x / temperatures + gumbel_noise(seeds[:, None], columns)
    return scores.masked_fill(x < floors, float("-inf")).argmax(dim=-1)


BLOCK = 1024
_PROGRAMS = 1024  # enough (row, slice) programs to keep every SM streaming


def race_logits_triton(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                       floors: torch.Tensor, seeds: torch.Tensor, *,
                       splits: int | None = None) -> torch.Tensor:
    """`race_logits` through the Triton kernel (CUDA, or CPU tensors in the interpreter). Each
    row's vocabulary is cut into `splits` slices raced by separate programs (default: enough
    for ~1,000 programs, each slice >= 8 blocks); the first slice holding the top score wins,
    so ties go to the smallest id as in one pass."""
    assert logits.stride(1) == 1 and logits.dtype == torch.float32
    n, vocab = len(rows), logits.shape[1]
    blocks = triton.cdiv(vocab, BLOCK)
    if splits is None:
        splits = max(1, min(triton.cdiv(_PROGRAMS, max(n, 1)), blocks // 8))
    chunk = triton.cdiv(blocks, splits) * BLOCK
    splits = triton.cdiv(vocab, chunk)
    best = torch.empty((n, splits), dtype=torch.float32, device=logits.device)
    best_id = torch.empty((n, splits), dtype=torch.int32, device=logits.device)
    if n:
        _race_logits_kernel[(n, splits)](
            logits, rows, temperatures, floors, seeds, best, best_id, vocab, logits.stride(0),
            chunk, BLOCK=BLOCK, num_warps=4)
    return best_id.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
