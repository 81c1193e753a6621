"""Top-k / top-p / min-p as one floor logit per row, found without sorting.

The exponential race (race.py) draws exactly from softmax(x / T) restricted to {x >= floor}, so a
cut row needs only its floor: the largest of
  - top-k: t_k, the k-th largest logit (counted with multiplicity);
  - top-p: t_p, the largest t whose mass m(t) = sum_{x >= t} e^{x/T}, renormalised over the
    top-k set {x >= t_k}, reaches top_p (the sort-based rule: a token is kept when the mass
    ranked strictly above it is < top_p);
  - min-p: max + T log(min_p) (p >= min_p p_max).
Ties: every token whose logit equals the floor is kept (sort-based code keeps an arbitrary subset
of a tie at the k-th place or at the nucleus' edge); the top-p mass renormalises over the whole
top-k set, ties included.

`cut_floors` (Triton; CUDA, or CPU tensors in the interpreter) finds t_k and t_p by a radix select
over the order-preserving uint32 image of each fp32 (or upcast bf16 / fp16) logit: 4 bits per
pass, each pass one read of the row that counts (top-k) or sums the mass (top-p) of the tokens
under the prefix found so far in 16 digit buckets, then takes the largest digit whose bucket and
those above it reach k (or top_p of the row's mass). bf16 rows need 4 passes (their image has
16 significant bits), fp16 5, fp32 8, plus a max pass when top-p or min-p is on. One program per
row, one launch for the batch, no host sync. `reference_floors` is the same rule in torch ops
(sorts a window of each row's best logits: the CPU's path and the kernel's reference).

    cut_floors(logits [bs, V], group) -> [n] float32
    reference_floors(logits [n, V] (the group's rows), group) -> [n] float32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmnb.runtime.sampling.batch_info import RowGroup

_NEG_INF = float("-inf")
FIRST_WINDOW = 64  # best logits the torch version sorts first (grows x8 until the nucleus fits)
_BITS = {torch.float32: 32, torch.float16: 20, torch.bfloat16: 16}  # significant image bits
BLOCK = 512  # tokens per step; a program holds [BLOCK, 16] digit sums
WARPS = 8


@triton.jit
def _image(x):
    """Order-preserving uint32 image of fp32 `x` (-0.0 maps with +0.0)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, ~u, u | 0x80000000)


@triton.jit
def _value(prefix, PASSES: tl.constexpr):
    """The logit whose image's top 4 * PASSES bits are `prefix`'s (its lower bits are those of
    the row's dtype upcast: 0 for a positive logit, 1 for a negative one, whose image is ~bits)."""
    low: tl.constexpr = (1 << (32 - 4 * PASSES)) - 1
    image = tl.where((prefix >> 31) != 0, prefix, prefix | low)
    u = tl.where((image >> 31) != 0, image & 0x7FFFFFFF, ~image)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _pick(hist, above, target):
    """The largest digit d with above + sum(hist[d:]) >= target (0 if none), and the new
    `above`: above + sum(hist[d + 1:])."""
    digits = tl.arange(0, 16)
    suffix = tl.sum(tl.where(digits[None, :] >= digits[:, None], hist[None, :], 0), 1)
    digit = tl.max(tl.where(above + suffix >= target, digits, 0), 0)
    return digit, above + tl.sum(tl.where(digits > digit, hist, 0), 0)


@triton.jit
def _load(base, start, vocab, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    return tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32), cols


@triton.jit
def _digit_counts(base, vocab, prefix, shift: tl.constexpr, BLOCK: tl.constexpr):
    """[16] counts of the row's tokens whose image matches `prefix` above bit shift + 4, by their
    digit at `shift` (accumulated per lane, reduced once)."""
    digits = tl.arange(0, 16)
    counts = tl.zeros([BLOCK, 16], tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        image = _image(x)
        live = (((image >> shift) >> 4) == ((prefix >> shift) >> 4)) & (cols < vocab)
        hit = (((image >> shift) & 15)[:, None] == digits[None, :]) & live[:, None]
        counts += hit.to(tl.int32)
    return tl.sum(counts, 0)


@triton.jit
def _digit_masses(base, vocab, prefix, shift: tl.constexpr, floor, best, inv_t,
                  BLOCK: tl.constexpr):
    """`_digit_counts` summing e^{(x - best) / T} of the tokens x >= floor."""
    digits = tl.arange(0, 16)
    masses = tl.zeros([BLOCK, 16], tl.float32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        image = _image(x)
        live = ((((image >> shift) >> 4) == ((prefix >> shift) >> 4)) & (cols < vocab)
                & (x >= floor))
        mass = tl.where(live, tl.exp((x - best) * inv_t), 0.0)
        hit = ((image >> shift) & 15)[:, None] == digits[None, :]
        masses += tl.where(hit, mass[:, None], 0.0)
    return tl.sum(masses, 0)


@triton.jit
def _floors_kernel(LOGITS, ROWS, TEMPS, TOP_KS, TOP_PS, MIN_PS, FLOORS, vocab, stride,
                   PASSES: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: the floor of row ROWS[i] (see the module's docstring) into FLOORS[i]."""
    i = tl.program_id(0)
    base = LOGITS + tl.load(ROWS + i).to(tl.int64) * stride
    k = tl.load(TOP_KS + i).to(tl.int32)
    p = tl.load(TOP_PS + i)
    min_p = tl.load(MIN_PS + i)
    temperature = tl.load(TEMPS + i)
    inv_t = 1.0 / temperature
    floor = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    if (p < 1.0) | (min_p > 0.0):
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            x, _ = _load(base, start, vocab, BLOCK)
            top = tl.maximum(top, x)
        best = tl.max(top, 0)
    if k < vocab:  # t_k: the largest t with count(x >= t) >= k
        prefix = tl.full([], 0, tl.uint32)
        above = tl.full([], 0, tl.int32)
        for j in tl.static_range(PASSES):
            counts = _digit_counts(base, vocab, prefix, 28 - 4 * j, BLOCK)
            digit, above = _pick(counts, above, k)
            prefix = prefix | (digit.to(tl.uint32) << (28 - 4 * j))
        floor = _value(prefix, PASSES)
    if p < 1.0:  # t_p: the largest t with mass(x >= t) >= p mass(x >= t_k)
        prefix = tl.full([], 0, tl.uint32)
        above = tl.full([], 0.0, tl.float32)
        target = tl.full([], 0.0, tl.float32)
        for j in tl.static_range(PASSES):
            masses = _digit_masses(base, vocab, prefix, 28 - 4 * j, floor, best, inv_t, BLOCK)
            if j == 0:
                target = p * tl.sum(masses, 0)
            digit, above = _pick(masses, above, target)
            prefix = prefix | (digit.to(tl.uint32) << (28 - 4 * j))
        floor = tl.maximum(floor, _value(prefix, PASSES))
    if min_p > 0.0:
        floor = tl.maximum(floor, best + temperature * tl.log(min_p))
    tl.store(FLOORS + i, tl.where(floor == floor, floor, float("-inf")))  # NaN rows: no floor


def cut_floors(logits: torch.Tensor, group: RowGroup, *, block: int = BLOCK,
               warps: int = WARPS) -> torch.Tensor:
    """[n] float32 floors of the group's rows of `logits` [bs, >= V] (float32, bfloat16 or
    float16, unit column stride; V the group's vocabulary: `group.top_ks` holds V for rows
    without top-k). -inf where nothing is cut. No host sync."""
    assert logits.stride(1) == 1 and logits.dtype in _BITS
    vocab = group.vocab_size
    floors = torch.empty(group.size, dtype=torch.float32, device=logits.device)
    if group.size:
        _floors_kernel[(group.size,)](
            logits, group.rows, group.temperatures, group.top_ks, group.top_ps, group.min_ps,
            floors, vocab, logits.stride(0), PASSES=triton.cdiv(_BITS[logits.dtype], 4),
            BLOCK=block, num_warps=warps)
    return floors


def reference_floors(logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """`cut_floors` in torch ops, `logits` [n, V] the group's rows. On the CPU top-p rows sort a
    window of their best logits that widens until their nucleus fits; elsewhere (no host sync)
    the whole row."""
    x = logits.float()
    n, vocab = x.shape
    temps = group.temperatures[:, 0]
    best = x.max(dim=-1).values
    floors = torch.full((n,), _NEG_INF, device=x.device)
    if group.max_cut_k:
        kth = x.topk(group.max_cut_k, dim=-1).values.gather(
            1, (group.top_ks.clamp(max=group.max_cut_k) - 1)[:, None])[:, 0]
        floors = torch.where(group.has_k, kth, floors)
    if group.any_top_p:
        p = group.top_ps[:, 0]
        scaled = ((x - best[:, None]) / temps[:, None]).masked_fill(x < floors[:, None], _NEG_INF)
        target = p * torch.exp(scaled).sum(dim=-1)
        window = vocab  # no host sync off the CPU: the whole row at once
        if x.device.type == "cpu":
            window = min(vocab, max(FIRST_WINDOW, group.max_cut_k))
        while True:
            values = x.topk(window, dim=-1).values  # best first
            mass = torch.exp(((values - best[:, None]) / temps[:, None])
                             .masked_fill(values < floors[:, None], _NEG_INF)).cumsum(dim=-1)
            reached = mass >= target[:, None]
            short = (p < 1.0) & ~reached[:, -1]
            if window == vocab or not bool(short.any()):
                break
            window = min(vocab, window * 8)
        edge = values.gather(1, reached.to(torch.int8).argmax(dim=-1, keepdim=True))[:, 0]
        floors = torch.where((p < 1.0) & reached[:, -1], torch.maximum(floors, edge), floors)
    if group.any_min_p:
        floors = torch.where(group.min_ps[:, 0] > 0,
                             torch.maximum(floors, best + temps * torch.log(group.min_ps[:, 0])),
                             floors)
    return torch.where(floors.isnan(), _NEG_INF, floors)
