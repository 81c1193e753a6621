"""What `generate` accepts as prompts, normalised to token-id lists (one definition for the
in-process runtime and the data-parallel one), and how a list of texts is encoded: in growing
chunks by the tokenizer's batch call, so that the first prompts reach the scheduler while the
rest are still being encoded."""

from __future__ import annotations

import numbers
import operator
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lmnb.params import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptInput = str | Sequence[str] | None
IdsInput = Sequence[int] | Sequence[Sequence[int]] | None

# Prompts in the first chunk of a list of texts; each later chunk is twice the one before.
FIRST_CHUNK = 8


def all_ints(values: Sequence[object]) -> bool:
    """Whether every value is an integer (bools and NumPy's included, as `numbers.Integral`
    says), checked at C speed for the usual plain-int lists; others take the per-item check."""
    return (set(map(type, values)) <= {int}
            or all(isinstance(v, numbers.Integral) for v in values))


def ids_in_range(ids: Sequence[object], vocab_size: int) -> bool:
    """Whether `ids` are integers in [0, vocab_size): packed into int64 at C speed (floats,
    strings and None refused, as `operator.index` refuses them), then NumPy's min and max; no
    per-token Python (a third of the time of a type scan, a min and a max over the list)."""
    if not ids:
        return True
    try:
        values = np.frombuffer(array("q", ids), dtype=np.int64)
    except (TypeError, OverflowError):
        return False
    return bool(values.min() >= 0 and values.max() < vocab_size)


def plain_ids(ids: Sequence[object]) -> list[object]:
    """A copy of `ids` whose integers are Python ints: NumPy's (and anything else
    `operator.index` takes, e.g. a 0-d integer tensor) would otherwise reach the outputs' token
    ids, JSON bodies and disk pages as given. Other values are kept for `ids_in_range` to refuse.
    Plain ints cost one C-speed sum (ints and bools add up to an int; a NumPy integer makes the
    sum its own type)."""
    copy = list(ids)
    try:
        if type(sum(copy)) is int:
            return copy
        return list(map(operator.index, copy))
    except (TypeError, OverflowError):  # not integers: refused by the range check
        return copy


def encode_many(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Per text the ids of `tokenizer.encode(text, add_special_tokens=True)`: a fast (Rust)
    tokenizer encodes them in one batch call, across cores and without the GIL; a slow one
    text by text, through that same call."""
    if not texts:
        return []
    if tokenizer.is_fast:
        return tokenizer(list(texts), add_special_tokens=True, return_attention_mask=False,
                         return_token_type_ids=False)["input_ids"]
    return [tokenizer.encode(text, add_special_tokens=True) for text in texts]


def chunk_bounds(count: int, first: int = FIRST_CHUNK) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive chunks of `count` items: `first`, then twice the size each
    time; a rest smaller than a chunk's size joins that chunk."""
    start, size = 0, max(first, 1)
    while start < count:
        end = min(count, start + size)
        if count - end < size:
            end = count
        yield start, end
        start, size = end, size * 2


@dataclass(frozen=True, slots=True)
class Prompts:
    """The prompts of one generate call, checked but not encoded: `texts` or `id_lists`."""

    texts: Sequence[str] | None
    id_lists: list[list[int]] | None
    is_batch: bool  # a list of prompts was given (the call returns a list)

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.id_lists or ())

    @property
    def encoded(self) -> bool:
        """Their ids come from the tokenizer (not from the caller)."""
        return self.texts is not None

    def chunks(self, encode: Callable[[Sequence[str]], list[list[int]]], *,
               first: int = FIRST_CHUNK) -> Iterator[tuple[int, list[list[int]]]]:
        """(index of the chunk's first prompt, its id lists): texts in growing chunks
        (`chunk_bounds`), each encoded by one `encode` call only when it is asked for, so that
        the first prompts are submitted while the tokenizer (which releases the GIL) encodes the
        rest; id lists in one chunk, all checked before any is submitted (their checks hold the
        GIL: chunks would not overlap them with the scheduler's work)."""
        if self.texts is None:
            yield 0, self.id_lists or []
            return
        for start, end in chunk_bounds(len(self.texts), first):
            yield start, encode(self.texts[start:end])


def split_prompts(prompt: PromptInput, input_ids: IdsInput) -> Prompts:
    """Exactly one of `prompt` (a string or a list of strings) or `input_ids` (ids or lists of
    ids); a bad shape is an `InvalidRequestError`."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequestError("give exactly one of prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return Prompts([prompt], None, False)
        if not prompt:
            raise InvalidRequestError("empty list of prompts")
        if not all(isinstance(p, str) for p in prompt):
            raise InvalidRequestError("prompt must be a string or a list of strings")
        return Prompts(prompt, None, True)
    if not input_ids:
        raise InvalidRequestError("empty input_ids")
    if all_ints(input_ids):
        return Prompts(None, [plain_ids(input_ids)], False)
    if all(isinstance(ids, list | tuple) for ids in input_ids):
        return Prompts(None, [plain_ids(ids) for ids in input_ids], True)
    raise InvalidRequestError("input_ids must be a list of ints or a list of lists of ints")


def prompt_id_lists(prompt: PromptInput, input_ids: IdsInput,
                    encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    """(one id list per prompt, whether a list of prompts was given); exactly one of `prompt`
    (a string or a list of strings, encoded by `encode`) or `input_ids` (ids or lists of ids)."""
    prompts = split_prompts(prompt, input_ids)
    if prompts.texts is not None:
        return [encode(text) for text in prompts.texts], prompts.is_batch
    return prompts.id_lists or [], prompts.is_batch
