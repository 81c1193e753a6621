"""Packed grammar bitmasks: packing round-trips, the bit layout, and the FSM's cached bitmasks
agree with its bool masks on every state of a regex over a small synthetic vocabulary."""

import itertools
import random

import pytest
import torch

from lmnb.runtime.fsm.grammar import RequestGrammar
from lmnb.runtime.fsm.index import TokenIndex, VocabTrie
from lmnb.runtime.fsm.regex import compile_regex
from lmnb.runtime.sampling import (
    all_allowed,
    apply_bitmask_,
    num_words,
    pack_mask,
    stack_bitmasks,
    unpack_bitmask,
)

ALPHABET = "ab01{}\":, "
EOS = 0


def synthetic_table() -> list[bytes | None]:
    """A special token (no bytes) then every string of 1 to 2 characters over ALPHABET."""
    strings = [a + b for a in ALPHABET for b in [""] + list(ALPHABET)]
    return [None] + [s.encode() for s in strings]


def make_index(pattern: str, vocab_size: int | None = None) -> TokenIndex:
    table = synthetic_table()
    return TokenIndex(compile_regex(pattern), table, VocabTrie(table), vocab_size=vocab_size)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 64, 1000, 4099])
def test_pack_round_trips(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    mask = torch.rand(5, vocab, generator=gen) < 0.5
    mask[0] = True
    mask[1] = False
    packed = pack_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (5, num_words(vocab))
    assert torch.equal(unpack_bitmask(packed, vocab), mask)
    assert torch.equal(pack_mask(mask[2]), packed[2])  # 1-d masks pack the same


def test_bit_layout_is_word_t_div_32_bit_t_mod_32() -> None:
    mask = torch.zeros(3, 70, dtype=torch.bool)
    mask[0, 0] = True
    mask[1, 31] = True
    mask[2, [33, 69]] = True
    assert pack_mask(mask).tolist() == [[1, 0, 0], [-(1 << 31), 0, 0], [0, 2, 1 << 5]]


def test_apply_bitmask_matches_bool_mask_and_pads() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    mask = torch.rand(4, 100) < 0.3
    expected = logits.masked_fill(~mask, float("-inf"))
    assert torch.equal(apply_bitmask_(logits.clone(), pack_mask(mask)), expected)
    # A bitmask narrower than the logits allows nothing past its end.
    narrow = pack_mask(torch.ones(4, 40, dtype=torch.bool))
    out = apply_bitmask_(logits.clone(), narrow)
    assert torch.isinf(out[:, 40:]).all() and torch.equal(out[:, :40], logits[:, :40])


def test_stack_pads_narrow_rows_and_keeps_all_ones() -> None:
    words = num_words(100)
    ones = all_allowed(words, "cpu")
    assert all_allowed(words, "cpu") is ones  # cached
    narrow = pack_mask(torch.ones(40, dtype=torch.bool))
    stacked = stack_bitmasks([ones, narrow], words)
    allowed = unpack_bitmask(stacked, 100)
    assert allowed[0].all()
    assert allowed[1, :40].all() and not allowed[1, 40:].any()


@pytest.mark.parametrize("pattern", [r"\{\"a\":[01]{1,3}(, \"b\":(a|b)+)?\}", r"(ab|ba)*0",
                                     r"a{2,5}"])
def test_index_bitmask_equals_bool_mask_on_every_state(pattern: str) -> None:
    vocab = 150  # past the table: padding tokens are never allowed
    index = make_index(pattern, vocab_size=vocab)
    index.build_all()
    states = list(range(index.fsm.num_states)) + [-1]
    for state in states:
        packed = index.bitmask(state)
        assert packed.shape == (num_words(vocab),)
        assert torch.equal(unpack_bitmask(packed[None], vocab)[0], index.allowed(state)), state
        assert index.bitmask(state) is packed  # cached per state


def test_grammar_bitmask_follows_its_bool_mask_along_random_walks() -> None:
    pattern = r"\{\"a\":[01]{1,3}(, \"b\":(a|b)+)?\}"
    index = make_index(pattern)
    rng = random.Random(0)
    stops = {EOS}
    for _ in range(20):
        grammar = RequestGrammar(index, pattern)
        for _ in itertools.count():
            mask = grammar.mask(stops)
            packed = grammar.bitmask(stops)
            assert torch.equal(unpack_bitmask(packed[None], index.vocab_size)[0], mask)
            assert grammar.bitmask(stops) is packed
            assert bool(mask[EOS]) == index.is_accepting(grammar.state)
            choices = [t for t in mask.nonzero().flatten().tolist() if t != EOS]
            if not choices or rng.random() < 0.1:
                break
            grammar.advance(rng.choice(choices))
    dead = RequestGrammar(index, pattern)
    dead.state = -1
    assert unpack_bitmask(dead.bitmask(stops)[None], index.vocab_size)[0].nonzero().tolist() \
        == [[EOS]]  # a dead end allows the stop ids only
