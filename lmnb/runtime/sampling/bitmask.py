"""Packed vocabulary masks: bit `t % 32` of int32 word `t // 32` says whether token t is allowed.

A [rows, words] bitmask is 32x smaller than a bool mask, so a grammar state's mask can live on
the device, cached, and a batch's mask is one stack of cached rows. `apply_bitmask_` is the single
op that applies it to logits (the place for a fused kernel later). The layout is xgrammar's too:
its `fill_next_token_bitmask` writes such rows directly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BITS = 32
_shifts: dict[str, torch.Tensor] = {}
_all_allowed: dict[tuple[int, str], torch.Tensor] = {}


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def _bit_shifts(device: torch.device) -> torch.Tensor:
    key = str(device)
    if (shifts := _shifts.get(key)) is None:
        shifts = _shifts[key] = torch.arange(BITS, dtype=torch.int32, device=device)
    return shifts


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., vocab] -> int32 [..., ceil(vocab / 32)] (padding bits are 0)."""
    vocab = mask.shape[-1]
    words = num_words(vocab)
    padded = torch.zeros(*mask.shape[:-1], words * BITS, dtype=torch.int64, device=mask.device)
    padded[..., :vocab] = mask
    shifts = _bit_shifts(mask.device).to(torch.int64)
    packed = (padded.view(*mask.shape[:-1], words, BITS) << shifts).sum(dim=-1)
    # [0, 2^32) -> the int32 with the same bits
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Int32 [rows, words] -> bool [rows, vocab_size]; tokens past words * 32 are not allowed."""
    rows, words = bitmask.shape
    bits = (bitmask[:, :, None] >> _bit_shifts(bitmask.device)) & 1  # [rows, words, 32]
    allowed = bits.view(rows, words * BITS).bool()
    if words * BITS >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - words * BITS))


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets the logits [rows, vocab] of tokens not allowed by `bitmask` [rows, words] to -inf,
    in place; returns `logits`."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))


def with_bits(row: torch.Tensor, token_ids: Iterable[int]) -> torch.Tensor:
    """A copy of the packed row [words] (on the CPU) with the bits of `token_ids` set; ids past
    the row are ignored."""
    out = row.clone()
    for token in token_ids:
        word, bit = divmod(token, BITS)
        if 0 <= word < out.numel():
            value = int(out[word]) | (1 << bit)
            out[word] = value - (1 << 32) if value >= 1 << 31 else value  # the same bits in int32
    return out


def all_allowed(words: int, device: torch.device | str) -> torch.Tensor:
    """The cached all-ones row [words] (for rows without a grammar); callers must not modify it."""
    key = (words, str(device))
    if (row := _all_allowed.get(key)) is None:
        row = _all_allowed[key] = torch.full((words,), -1, dtype=torch.int32, device=device)
    return row


def stack_bitmasks(rows: list[torch.Tensor], words: int) -> torch.Tensor:
    """[len(rows), words]: rows narrower than `words` allow nothing past their end, wider rows
    are cut."""
    fitted = [row if row.numel() == words
              else torch.nn.functional.pad(row, (0, words - row.numel()))[:words]
              for row in rows]
    return torch.stack(fitted)
