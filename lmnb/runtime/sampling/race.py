"""Drawing tokens by the exponential race (the Gumbel-max trick): a row with unnormalised weights w
draws argmax_i w_i / E_i with E_i ~ Exp(1) i.i.d., which picks token i with probability
w_i / sum(w). On logits: argmax_i (x_i / T + G_i), G_i = -log E_i ~ Gumbel(0, 1), so a row sampled
at temperature T over the whole vocabulary needs one read of its logits: no softmax, no cumulative
sum, no normaliser.

The noise is a counter-based hash of (row seed, token id), identical in the torch version and the
Triton kernel: a row's draw depends only on its weights and its seed, so a seeded request's tokens
do not depend on its batch. Seeds are [rows] int64 tensors on the device (`row_seeds`): random
per step, or drawn from a request's own generator.

On a GPU, `sample_rows` reads each row once in its own dtype (bf16 logits are upcast in the
kernel, which is exact) and gives, besides the race's winner, the row's largest logit: the greedy
rows' token (its first index) and the MASKED / NOT_FINITE verdicts, without a separate max pass.

    race_logits(logits [bs, V], rows [n], temperatures [n, 1], floors [n, 1], seeds [n]) -> [n] ids
    sample_rows(logits [bs, V], rows [n], temperatures [n], floors [n], seeds [n]) -> [n] ids
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.sampling.output import MASKED, NOT_FINITE

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B
SEED_BOUND = 1 << 31
_MASKED = tl.constexpr(MASKED)  # the verdicts, as the kernels see them
_NOT_FINITE = tl.constexpr(NOT_FINITE)


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


@triton.jit
def _hash32_tl(x):
    """`_hash32` on uint32 lanes (literals >= 2^31 are uint32 in Triton, so products wrap)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_rows_kernel(LOGITS, ROWS, TEMPS, FLOORS, SEEDS, TOP, TOP_ID, BEST, BEST_ID, vocab,
                        stride, chunk, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
    """Program (i, s) reads row ROWS[i]'s tokens s * chunk : (s + 1) * chunk and stores at [i, s]
    their largest logit (NaN if one is NaN) with its first index, and, for a row with TEMPS > 0,
    the race's best score with the smallest id among equal scores. GREEDY: row i of every row,
    no race (ROWS, TEMPS, FLOORS, SEEDS, BEST and BEST_ID unread)."""
    i = tl.program_id(0)
    part = tl.program_id(1)
    at = i * tl.num_programs(1) + part
    if GREEDY:
        row = i.to(tl.int64)
        races = False
        inv_t, floor, seed = 1.0, float("-inf"), 0
    else:
        row = tl.load(ROWS + i).to(tl.int64)
        temperature = tl.load(TEMPS + i)
        races = temperature > 0
        inv_t = 1.0 / tl.where(races, temperature, 1.0)
        floor = tl.load(FLOORS + i)  # logits below it are out of the support (min-p); -inf: none
        seed = tl.load(SEEDS + i).to(tl.uint32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    top_id = tl.zeros([BLOCK], tl.int32)
    nan = tl.zeros([BLOCK], tl.int32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)  # a row with no finite score draws id 0
    end = tl.minimum((part + 1) * chunk, vocab)
    for start in range(part * chunk, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * stride + cols, mask=cols < end,
                    other=float("-inf")).to(tl.float32)
        higher = x > top  # strictly: each lane keeps its first maximum
        top = tl.where(higher, x, top)
        top_id = tl.where(higher, cols, top_id)
        nan = nan | (x != x).to(tl.int32)
        if races:
            h = _hash32_tl(_hash32_tl((cols.to(tl.uint32) * 0x9E3779B9) ^ seed))
            uniform = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as gumbel_noise
            score = tl.where(x >= floor, x * inv_t - tl.log(-tl.log(uniform)),
                             float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_id = tl.where(better, cols, best_id)
    largest = tl.max(top, 0)
    tl.store(TOP_ID + at, tl.min(tl.where(top == largest, top_id, vocab), 0))
    tl.store(TOP + at, tl.where(tl.max(nan, 0) > 0, float("nan"), largest))
    if not GREEDY:
        score = tl.max(best, 0)
        tl.store(BEST + at, score)
        tl.store(BEST_ID + at, tl.min(tl.where(best == score, best_id, vocab), 0))


@triton.jit
def _pick_kernel(TOP, TOP_ID, BEST, BEST_ID, TEMPS, IDS, n, splits, ROWS: tl.constexpr,
                 SPLITS: tl.constexpr, GREEDY: tl.constexpr):
    """Per row: the first slice holding the largest score wins (so ties go to the smallest id,
    as in one pass); the race's winner for a row with TEMPS > 0, else the first maximal logit;
    MASKED / NOT_FINITE when the largest logit is -inf / NaN or +inf. GREEDY: no row races
    (BEST, BEST_ID and TEMPS unread)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slices = tl.arange(0, SPLITS)[None, :]
    live = rows < n
    mask = live[:, None] & (slices < splits)
    at = rows[:, None] * splits + slices
    top = tl.load(TOP + at, mask=mask, other=float("-inf"))
    nan = tl.max((top != top).to(tl.int32), 1) > 0
    top = tl.where(top != top, float("-inf"), top)
    largest = tl.max(top, 1)
    first = tl.min(tl.where(top == largest[:, None], slices, SPLITS), 1)
    greedy = tl.sum(tl.where(slices == first[:, None], tl.load(TOP_ID + at, mask=mask, other=0),
                             0), 1)
    if GREEDY:
        ids = greedy.to(tl.int64)
    else:
        best = tl.load(BEST + at, mask=mask, other=float("-inf"))
        first = tl.min(tl.where(best == tl.max(best, 1)[:, None], slices, SPLITS), 1)
        drawn = tl.sum(tl.where(slices == first[:, None],
                                tl.load(BEST_ID + at, mask=mask, other=0), 0), 1)
        ids = tl.where(tl.load(TEMPS + rows, mask=live, other=0.0) > 0, drawn,
                       greedy).to(tl.int64)
    ids = tl.where(largest == float("-inf"), _MASKED, ids)
    ids = tl.where(nan | (largest == float("inf")), _NOT_FINITE, ids)
    tl.store(IDS + rows, ids, mask=live)


def race_logits(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                floors: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """[n] token ids: row rows[j] of `logits` [bs, V] at temperature temperatures[j] over the
    tokens whose logit is >= floors[j] (min-p; -inf: all), in torch ops (the CPU's path and the
    reference of `sample_rows`, which draws the same tokens)."""
    x = logits[rows].float()
    columns = torch.arange(x.shape[1], device=x.device)[None, :]
    scores = x / temperatures + gumbel_noise(seeds[:, None], columns)
    return scores.masked_fill(x < floors, float("-inf")).argmax(dim=-1)


BLOCK = 1024  # tokens per step of a program
WARPS = 8
_PROGRAMS = 2048  # enough (row, slice) programs to keep every SM streaming (H100 sweep)
_PICK_ROWS = 64


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                floors: torch.Tensor, seeds: torch.Tensor, *, splits: int | None = None,
                block: int = BLOCK, warps: int = WARPS) -> torch.Tensor:
    """[n] int64 token ids of rows `rows` [n] of `logits` [bs, V] (float32, bfloat16 or float16,
    unit column stride), in one read of each row (Triton: CUDA, or CPU tensors in the
    interpreter): a row with temperatures[j] > 0 races (`race_logits`' token) over the tokens whose
    logit is >= floors[j], any other row takes its first maximal logit; MASKED for a row whose
    every logit is -inf, NOT_FINITE for one holding NaN or +inf. `temperatures`, `floors` [n]
    float32 and `seeds` [n] int64, contiguous. Each row's vocabulary is cut into `splits` slices
    read by separate programs (default: enough for ~2,000 programs, each slice >= 8 blocks of
    `block` tokens; `warps` per program); the draw does not depend on them. No host sync."""
    return _launch(logits, len(rows), (rows, temperatures, floors, seeds), splits, block, warps)


def greedy_rows(logits: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
    """[bs] int64 ids: each row's first maximal logit of `logits` [bs, V], MASKED / NOT_FINITE as
    `sample_rows` gives them (its kernels without the race: the ids of `sample_rows` with every
    temperature 0, in one read of each row and no tensor besides the result's)."""
    return _launch(logits, logits.shape[0], None, splits, BLOCK, WARPS)


def _launch(logits: torch.Tensor, n: int,
            race: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
            splits: int | None, block: int, warps: int) -> torch.Tensor:
    """The (row, slice) pass and the pick over `n` rows; `race` (rows, temperatures, floors,
    seeds), or None for greedy rows 0..n-1."""
    assert logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16,
                                                       torch.float16)
    vocab = logits.shape[1]
    blocks = triton.cdiv(vocab, block)
    if splits is None:
        splits = max(1, min(triton.cdiv(_PROGRAMS, max(n, 1)), blocks // 8))
    chunk = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(vocab, chunk)
    device = logits.device
    greedy = race is None
    scores = torch.empty((1 if greedy else 2, n, splits), dtype=torch.float32,
                         device=device)  # top, best
    at = torch.empty_like(scores, dtype=torch.int32)  # their ids
    ids = torch.empty(n, dtype=torch.int64, device=device)
    rows, temperatures, floors, seeds = race or (logits,) * 4  # unread when greedy
    best, best_id = (scores[0], at[0]) if greedy else (scores[1], at[1])
    if n:
        _sample_rows_kernel[(n, splits)](
            logits, rows, temperatures, floors, seeds, scores[0], at[0], best, best_id, vocab,
            logits.stride(0), chunk, BLOCK=block, GREEDY=greedy, num_warps=warps)
        _pick_kernel[(triton.cdiv(n, _PICK_ROWS),)](
            scores[0], at[0], best, best_id, temperatures, ids, n, splits, ROWS=_PICK_ROWS,
            SPLITS=max(2, triton.next_power_of_2(splits)), GREEDY=greedy, num_warps=4)
    return ids
