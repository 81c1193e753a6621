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
16 significant bits), fp16 5, fp32 8, plus a max pass when top-p or min-p is on. Each row is
cut into slices of whole blocks (as `race.sample_rows` does): a pass is one launch of a program per
(row, slice) that sums the previous pass's buckets of its row's slices, picks that pass's digit
and stores its slice's 16 bucket counts / masses (by pass parity), a last small launch picks the
last digit; no host sync. Counts are exact, so top-k and min-p floors do not depend on the
slicing; top-p's bucket masses are float sums whose order does, so a top-p floor can differ only
where the mass ranked above the nucleus' edge is within rounding of top_p (the target is top_p
times the sum of the first pass's buckets, as before; with one slice per row the sums are the
one-program kernel's, bit for bit). `reference_floors` is the same rule in torch ops (sorts a
window of each row's best logits: the CPU's path and the kernel's reference).

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
BLOCK = 256  # tokens per step; a program holds [BLOCK, 16] digit sums
WARPS = 4
_PROGRAMS = 4096  # (row, slice) programs a launch aims at (H100 sweep: 16-32 slices a row best)
_MIN_BLOCKS = 4  # blocks a slice holds at least


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
def _any(live, SKIP: tl.constexpr):
    """Whether a block's update is needed: with SKIP, only if a token of it is live."""
    if SKIP:
        return tl.max(live.to(tl.int32), 0) > 0
    else:
        return True


@triton.jit
def _slice_digits(base, start, end, prefix, shift, floor, best, inv_t,
                  BLOCK: tl.constexpr, SKIP: tl.constexpr, MASS: tl.constexpr):
    """[16] float32 sums over the tokens start:end whose image matches `prefix` above bit
    shift + 4, by their digit at `shift` (accumulated per lane, reduced once): their counts
    (exact: < 2^24), or with MASS their e^{(x - best) / T} (inv_t = 1 / T) where x >= floor
    (`floor`, `best`, `inv_t` unread without MASS). SKIP: blocks without such a token skip the
    [BLOCK, 16] update (they add zeros)."""
    digits = tl.arange(0, 16)
    if MASS:
        sums = tl.zeros([BLOCK, 16], tl.float32)
    else:
        sums = tl.zeros([BLOCK, 16], tl.int32)
    for at in range(start, end, BLOCK):
        x, cols = _load(base, at, end, BLOCK)
        image = _image(x)
        live = (((image >> shift) >> 4) == ((prefix >> shift) >> 4)) & (cols < end)
        if MASS:
            live = live & (x >= floor)
        if _any(live, SKIP):
            if MASS:
                mass = tl.where(live, tl.exp((x - best) * inv_t), 0.0)
                hit = ((image >> shift) & 15)[:, None] == digits[None, :]
                sums += tl.where(hit, mass[:, None], 0.0)
            else:
                hit = (((image >> shift) & 15)[:, None] == digits[None, :]) & live[:, None]
                sums += hit.to(tl.int32)
    return tl.sum(sums, 0).to(tl.float32)


@triton.jit
def _row_best(BESTS, i, splits, SPLITS: tl.constexpr):
    """Row i's largest logit from its slices' maxima BESTS[i, :splits]."""
    slices = tl.arange(0, SPLITS)
    return tl.max(tl.load(BESTS + i * splits + slices, mask=slices < splits,
                          other=float("-inf")), 0)


@triton.jit
def _max_kernel(LOGITS, ROWS, TOP_PS, MIN_PS, BESTS, vocab, stride, chunk,
                BLOCK: tl.constexpr):
    """Program (i, s): the largest logit of row ROWS[i]'s slice s into BESTS[i, s] (rows with a
    top-p or a min-p)."""
    i = tl.program_id(0)
    part = tl.program_id(1)
    if (tl.load(TOP_PS + i) < 1.0) | (tl.load(MIN_PS + i) > 0.0):
        base = LOGITS + tl.load(ROWS + i).to(tl.int64) * stride
        end = tl.minimum((part + 1) * chunk, vocab)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(part * chunk, end, BLOCK):
            x, _ = _load(base, start, end, BLOCK)
            top = tl.maximum(top, x)
        tl.store(BESTS + i * tl.num_programs(1) + part, tl.max(top, 0))


@triton.jit
def _next_prefix(TOP_KS, TOP_PS, PARTS, PREFIXES, ABOVES, TARGETS, i, splits,
                 shift, MASS: tl.constexpr, FIRST: tl.constexpr,
                 SPLITS: tl.constexpr):
    """Row i after a pass: (prefix, above, target) with its digit at `shift` picked from its
    slices' buckets PARTS[i, :splits, :16] (the largest digit whose bucket and those above reach
    the target: k, or top_p of the first pass's mass), from the pass's PREFIXES / ABOVES /
    TARGETS[i] (FIRST: 0, 0 and the target)."""
    slices = tl.arange(0, SPLITS)[:, None]
    digits = tl.arange(0, 16)[None, :]
    hist = tl.sum(tl.load(PARTS + (i * splits + slices) * 16 + digits,
                          mask=(slices < splits) & (digits < 16), other=0.0), 0)
    if FIRST:
        prefix = tl.full([], 0, tl.uint32)
        above = tl.full([], 0.0, tl.float32)
        if MASS:
            target = tl.load(TOP_PS + i) * tl.sum(hist, 0)
        else:
            target = tl.load(TOP_KS + i).to(tl.float32)
    else:
        prefix = tl.load(PREFIXES + i).to(tl.uint32, bitcast=True)
        above = tl.load(ABOVES + i)
        target = tl.load(TARGETS + i)
    digit, above = _pick(hist, above, target)
    return prefix | (digit.to(tl.uint32) << shift), above, target


@triton.jit
def _active(TOP_KS, TOP_PS, i, vocab, MASS: tl.constexpr):
    """Whether row i takes part in the top-p (MASS) or the top-k passes."""
    if MASS:
        return tl.load(TOP_PS + i) < 1.0
    else:
        return tl.load(TOP_KS + i) < vocab


# `shift` a plain argument, never specialized: the 4-8 passes of a row share 3 compiles (first,
# second, the rest), not one each (an engine's start compiles them).
@triton.jit(do_not_specialize=["shift"])
def _digits_kernel(LOGITS, ROWS, TEMPS, TOP_KS, TOP_PS, FLOORS, BESTS, PARTS_IN, PREFIXES_IN,
                   ABOVES_IN, TARGETS_IN, PARTS, PREFIXES, ABOVES, TARGETS, vocab, stride, chunk,
                   shift, MASS: tl.constexpr, FIRST: tl.constexpr,
                   SECOND: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                   SKIP: tl.constexpr):
    """Program (i, s), one pass: row ROWS[i]'s prefix from the previous pass (its buckets
    PARTS_IN and state *_IN: `_next_prefix`, stored by slice 0 into PREFIXES / ABOVES / TARGETS;
    FIRST: the empty prefix), then slice s's tokens under it by digit at `shift` into
    PARTS[i, s, :16]: counted (rows with a top-k) or, with MASS, their mass above the top-k floor
    FLOORS[i] (rows with a top-p)."""
    i = tl.program_id(0)
    part = tl.program_id(1)
    splits = tl.num_programs(1)
    if _active(TOP_KS, TOP_PS, i, vocab, MASS):
        if FIRST:
            prefix = tl.full([], 0, tl.uint32)
        else:
            prefix, above, target = _next_prefix(TOP_KS, TOP_PS, PARTS_IN, PREFIXES_IN,
                                                 ABOVES_IN, TARGETS_IN, i, splits, shift + 4,
                                                 MASS, SECOND, SPLITS)
            if part == 0:
                tl.store(PREFIXES + i, prefix.to(tl.int32, bitcast=True))
                tl.store(ABOVES + i, above)
                tl.store(TARGETS + i, target)
        base = LOGITS + tl.load(ROWS + i).to(tl.int64) * stride
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        if MASS:
            inv_t = 1.0 / tl.load(TEMPS + i)
            best = _row_best(BESTS, i, splits, SPLITS)
            floor = tl.load(FLOORS + i)
        else:  # unread
            inv_t, best, floor = 1.0, 0.0, 0.0
        hist = _slice_digits(base, start, end, prefix, shift, floor, best, inv_t, BLOCK, SKIP,
                             MASS)
        tl.store(PARTS + (i * splits + part) * 16 + tl.arange(0, 16), hist)


@triton.jit
def _last_kernel(TOP_KS, TOP_PS, PARTS, PREFIXES, ABOVES, TARGETS, FLOORS, vocab, splits,
                 MASS: tl.constexpr, PASSES: tl.constexpr, SPLITS: tl.constexpr):
    """Program i: row i's last digit (`_next_prefix`), its floor into FLOORS[i] (with MASS: the
    larger of it and the top-k floor there)."""
    i = tl.program_id(0)
    if _active(TOP_KS, TOP_PS, i, vocab, MASS):
        prefix, _, _ = _next_prefix(TOP_KS, TOP_PS, PARTS, PREFIXES, ABOVES, TARGETS, i, splits,
                                    32 - 4 * PASSES, MASS, False, SPLITS)
        value = _value(prefix, PASSES)
        if MASS:
            value = tl.maximum(tl.load(FLOORS + i), value)
        tl.store(FLOORS + i, value)


@triton.jit
def _finish_kernel(TEMPS, MIN_PS, BESTS, FLOORS, splits, SPLITS: tl.constexpr):
    """Program i: the min-p floor max + T log(min_p) into FLOORS[i]; NaN floors become -inf."""
    i = tl.program_id(0)
    floor = tl.load(FLOORS + i)
    min_p = tl.load(MIN_PS + i)
    if min_p > 0.0:
        best = _row_best(BESTS, i, splits, SPLITS)
        floor = tl.maximum(floor, best + tl.load(TEMPS + i) * tl.log(min_p))
    tl.store(FLOORS + i, tl.where(floor == floor, floor, float("-inf")))  # NaN rows: no floor


def floor_slices(rows: int, vocab: int, block: int = BLOCK) -> int:
    """Default slices per row: enough for ~_PROGRAMS programs, each >= _MIN_BLOCKS blocks."""
    return max(1, min(triton.cdiv(_PROGRAMS, max(rows, 1)),
                      triton.cdiv(vocab, block) // _MIN_BLOCKS))


def cut_floors(logits: torch.Tensor, group: RowGroup, *, block: int = BLOCK,
               warps: int = WARPS, splits: int | None = None, skip: bool = True) -> torch.Tensor:
    """[n] float32 floors of the group's rows of `logits` [bs, >= V] (float32, bfloat16 or
    float16, unit column stride; V the group's vocabulary: `group.top_ks` holds V for rows
    without top-k). -inf where nothing is cut. Each row is cut into `splits` slices of whole
    blocks of `block` tokens (default `floor_slices`), each read by its own program (`warps`
    warps); the floors do not depend on them but through the order of top-p's float sums.
    `skip`: passes after the first skip the blocks holding no token under the prefix (the same
    sums). No host sync."""
    assert logits.stride(1) == 1 and logits.dtype in _BITS
    vocab, n = group.vocab_size, group.size
    floors = torch.full((n,), _NEG_INF, dtype=torch.float32, device=logits.device)
    if not n:
        return floors
    blocks = triton.cdiv(vocab, block)
    chunk = triton.cdiv(blocks, splits or floor_slices(n, vocab, block)) * block
    splits = triton.cdiv(vocab, chunk)
    passes = triton.cdiv(_BITS[logits.dtype], 4)
    device = logits.device
    bests = torch.empty((n, splits), dtype=torch.float32, device=device)
    parts = torch.empty((2, n, splits, 16), dtype=torch.float32, device=device)  # by pass parity
    prefixes = torch.empty((2, n), dtype=torch.int32, device=device)
    aboves = torch.empty((2, n), dtype=torch.float32, device=device)
    targets = torch.empty((2, n), dtype=torch.float32, device=device)
    padded = max(16, triton.next_power_of_2(splits))  # one compile up to 16 slices
    grid = (n, splits)
    if group.any_top_p or group.any_min_p:
        _max_kernel[grid](logits, group.rows, group.top_ps, group.min_ps, bests, vocab,
                          logits.stride(0), chunk, BLOCK=block, num_warps=warps)
    for mass in (False, True):
        if not (group.any_top_p if mass else group.max_cut_k):
            continue
        for j in range(passes):
            now, before = j % 2, (j + 1) % 2
            _digits_kernel[grid](
                logits, group.rows, group.temperatures, group.top_ks, group.top_ps, floors,
                bests, parts[before], prefixes[before], aboves[before], targets[before],
                parts[now], prefixes[now], aboves[now], targets[now], vocab, logits.stride(0),
                chunk, shift=28 - 4 * j, MASS=mass, FIRST=j == 0, SECOND=j == 1, BLOCK=block,
                SPLITS=padded, SKIP=skip and j > 0, num_warps=warps)
        last = (passes - 1) % 2
        _last_kernel[(n,)](group.top_ks, group.top_ps, parts[last], prefixes[last],
                           aboves[last], targets[last], floors, vocab, splits, MASS=mass,
                           PASSES=passes, SPLITS=padded, num_warps=1)
    _finish_kernel[(n,)](group.temperatures, group.min_ps, bests, floors, splits,
                         SPLITS=padded, num_warps=1)
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
