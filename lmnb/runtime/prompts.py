"""What `generate` accepts as prompts, normalised to token-id lists (one definition for the
in-process runtime and the data-parallel one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmnb.params import InvalidRequestError

PromptInput = str | Sequence[str] | None
IdsInput = Sequence[int] | Sequence[Sequence[int]] | None


def all_ints(values: Sequence[object]) -> bool:
    """Whether every value is an int (bools included, as `isinstance` says), checked at C speed
    for the usual plain-int lists; other int subclasses take the per-item check."""
    return set(map(type, values)) <= {int} or all(isinstance(v, int) for v in values)


def ids_in_range(ids: Sequence[object], vocab_size: int) -> bool:
    """Whether `ids` are ints in [0, vocab_size) (C-speed min/max, no per-token Python)."""
    return not ids or (all_ints(ids) and min(ids) >= 0 and max(ids) < vocab_size)


def prompt_id_lists(prompt: PromptInput, input_ids: IdsInput,
                encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    """(one id list per prompt, whether a list of prompts was given); exactly one of `prompt`
    (a string or a list of strings, encoded by `encode`) or `input_ids` (ids or lists of ids)."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequestError("give exactly one of prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return [encode(prompt)], False
        if not prompt:
            raise InvalidRequestError("empty list of prompts")
        if not all(isinstance(p, str) for p in prompt):
            raise InvalidRequestError("prompt must be a string or a list of strings")
        return [encode(p) for p in prompt], True
    if not input_ids:
        raise InvalidRequestError("empty input_ids")
    if all_ints(input_ids):
        return [list(input_ids)], False
    if all(isinstance(ids, list | tuple) for ids in input_ids):
        return [list(ids) for ids in input_ids], True
    raise InvalidRequestError("input_ids must be a list of ints or a list of lists of ints")
