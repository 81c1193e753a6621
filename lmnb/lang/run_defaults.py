"""A run's sampling defaults: which `run`/`run_batch` keywords set every gen's default, and
how a call's arguments become the program's."""

from __future__ import annotations

import functools
from typing import Any

from lmnb.lang.ir import GEN_PARAM_NAMES, GenParams
from lmnb.params import default_sampling_params

# `run`/`run_batch` keywords that set every gen's default: the gen arguments except those that
# only make sense per gen (a sample count, an output constraint).
SAMPLING_DEFAULT_KEYS = tuple(k for k in GEN_PARAM_NAMES
                              if k not in ("n", "regex", "json_schema", "ebnf"))
# SGLang's `run` keywords that set no gen default here: `n` (a state holds one sample, so 1
# only; give a gen its own `n`) and `use_thread` (every body runs on the program loop).
SGLANG_RUN_OPTIONS = ("n", "use_thread")
# The runtime's own scalar defaults; stop lists stay unset (the chat template may add its own).
RUN_DEFAULTS = GenParams(**{k: v for k, v in default_sampling_params().items()
                            if k in SAMPLING_DEFAULT_KEYS and not isinstance(v, list)})


def batch_defaults(sampling: dict[str, Any]) -> GenParams:
    """`run_batch`'s keyword arguments: sampling defaults only."""
    unknown = sorted(set(sampling) - {*SAMPLING_DEFAULT_KEYS, "n"})
    if unknown:
        raise TypeError(f"run_batch got unknown keyword arguments {unknown}")
    return run_defaults(sampling)


def call_arguments(item: Any) -> tuple[tuple, dict[str, Any]]:
    """One `run_batch` item as (positional, keyword) arguments: a dict of keyword arguments or,
    as SGLang accepts, a list or tuple of positional ones."""
    if isinstance(item, list | tuple):
        return tuple(item), {}
    return (), dict(item)


def run_defaults(sampling: dict[str, Any]) -> GenParams:
    values = dict(sampling)
    n = values.pop("n", None)
    values.pop("use_thread", None)
    if n not in (None, 1):
        raise ValueError(f"run(n={n!r}): a run's state holds one sample; give the gen its own "
                         f"n (gen(..., n={n!r}))")
    for key in ("stop", "stop_token_ids"):
        if isinstance(values.get(key), str | int):
            values[key] = (values[key],)
        elif values.get(key) is not None:
            values[key] = tuple(values[key])
    return GenParams(**values).merged_over(RUN_DEFAULTS)


@functools.lru_cache(maxsize=1024)
def _merged(params: GenParams, defaults: GenParams) -> GenParams:
    return params.merged_over(defaults)


def merged_over_defaults(params: GenParams, defaults: GenParams) -> GenParams:
    """`params.merged_over(defaults)`, computed once per distinct pair (a batch's programs
    write the same gens)."""
    try:
        return _merged(params, defaults)
    except TypeError:  # a value that cannot be hashed (a dict, a list)
        return params.merged_over(defaults)
