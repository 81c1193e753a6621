"""Expression nodes of the DSL. Immutable; `+` concatenates (`"Grade: " + gen("grade")`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lmnb.params import (
    GEN_ARGUMENTS,
    SAMPLING_PARAM_NAMES,
    SamplingParams,
    merged_params,
    stop_regex_patterns,
)

# `gen(dtype=...)`'s constraints, as SGLang's (`sglang.lang.ir`): int and float may end in spaces
# or newlines, which the automatic stop (" ", "\n") then cuts; str is a quoted run of word
# characters and spaces.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


class Expr:
    """Base of every node; `a + b` builds an `ExprList`."""

    def __add__(self, other: Any) -> ExprList:
        return concat(self, other)

    def __radd__(self, other: Any) -> ExprList:
        return concat(other, self)


class InvalidExprError(TypeError, ValueError):
    """A value appended to a program state that is neither text nor a DSL expression: a
    TypeError, and a ValueError as SGLang raises for it (`s += 5`, `forks += 5`)."""


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, list | tuple):
        return concat(*value)
    raise InvalidExprError(f"cannot add {type(value).__name__} to a program state; use str or "
                           f"DSL expressions (gen, select, image, roles...)")


def concat(*values: Any) -> ExprList:
    items: list[Expr] = []
    for value in values:
        expr = to_expr(value)
        items.extend(expr.items if isinstance(expr, ExprList) else (expr,))
    return ExprList(tuple(items))


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class GenParams:
    """The parameters one `gen` (or a run's defaults) sets: a partial of `SamplingParams` plus
    the logprob options, under their `lmnb.params` names (`GEN_ARGUMENTS` maps `gen`'s keywords
    to them); None means unset ("inherit the run's default").

    Hashable: `stop`, `stop_token_ids` and `stop_regex` are kept as tuples (one value or a list
    is accepted). Values may be tracing placeholders (`Argument`, `Variable`) until bound.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "stop_regex"):
            value = getattr(self, name)
            if isinstance(value, str | int):
                value = (value,)
            elif isinstance(value, Iterable):
                value = tuple(value)
            if name == "stop_regex" and isinstance(value, tuple) \
                    and all(isinstance(v, str) for v in value):
                value = tuple(stop_regex_patterns(value)) or None  # checked early, at `gen`
            object.__setattr__(self, name, value)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> GenParams:
        """The parameters of `gen`'s keyword `arguments` (its names: `max_tokens`, ...), renamed
        by `lmnb.params.GEN_ARGUMENTS`."""
        unknown = sorted(set(arguments) - set(GEN_ARGUMENTS))
        if unknown:
            raise TypeError(f"gen got unknown arguments {unknown}; known: {sorted(GEN_ARGUMENTS)}")
        return cls(**{GEN_ARGUMENTS[name]: value for name, value in arguments.items()})

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These arguments, with the unset ones taken from `defaults` (`merged_params`)."""
        return GenParams(**merged_params(defaults.set_values(), self.set_values()))

    def set_values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def sampling_values(self) -> dict[str, Any]:
        """The set sampling parameters, as a request's dict has them (tuples as lists)."""
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in self.set_values().items() if name in SAMPLING_PARAM_NAMES}

    def sampling_params(self) -> SamplingParams:
        """The request's `SamplingParams` of these (merged) parameters; the unset ones at
        SamplingParams' defaults. Raises `InvalidRequestError` naming a bad value."""
        return SamplingParams.merged(self.sampling_values())


GEN_PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(GenParams))


# Where a `gen`/`select` was written: (file name, line) of the program's source, so that an error
# raised while it runs (on the program's worker thread) can point at that line.
SourceLocation = tuple[str, int]


@dataclass(frozen=True)
class Gen(Expr):
    """`reasoning`: a model type whose reasoning is split off the output (`separate_reasoning`)."""

    name: str | None
    params: GenParams = field(default_factory=GenParams)
    reasoning: str | None = None
    where: SourceLocation | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: str = "token_length_normalized"
    reasoning: str | None = None
    where: SourceLocation | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Image(Expr):
    source: Any  # a path, URL-less file name, bytes or a PIL image


@dataclass(frozen=True)
class Video(Expr):
    source: Any
    num_frames: int = 8


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class CommitPrefix(Expr):
    """Hint: the text so far will be shared (forks, batches); cache it in the backend now."""


@dataclass(frozen=True)
class SetVar(Expr):
    name: str
    value: Any


@dataclass(frozen=True)
class Variable(Expr):
    """The value of variable `name` of state `state_id` (tracing: not known yet)."""

    name: str
    state_id: int


@dataclass(frozen=True)
class Argument(Expr):
    """A program argument not bound yet (tracing)."""

    name: str


@dataclass(frozen=True)
class ForkItem(Expr):
    """Tracing: the start of branch `index` of fork `fork_id` of state `state_id`."""

    state_id: int
    fork_id: int
    index: int


JOIN_MODES = ("gather_variable", "concat_and_append")
_JOIN_ALIASES = {"concate_and_append": "concat_and_append"}  # SGLang's spelling


def join_mode(mode: str) -> str:
    """The join mode `mode` names (SGLang's `concate_and_append` accepted)."""
    mode = _JOIN_ALIASES.get(mode, mode)
    if mode not in JOIN_MODES:
        raise ValueError(f"unknown join mode {mode!r}; use one of {JOIN_MODES}")
    return mode


@dataclass(frozen=True)
class Join(Expr):
    """Tracing: `mode` join of the branches `branch_ids` into the state."""

    branch_ids: tuple[int, ...]
    mode: str
