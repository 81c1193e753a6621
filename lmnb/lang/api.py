"""The DSL's vocabulary: functions that build expression nodes (SGLang's names and arguments)."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lmnb.lang.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Expr,
    ExprList,
    Gen,
    GenParams,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SourceLocation,
    Video,
    concat,
    to_expr,
)
from lmnb.lang.reasoning import reasoning_format, reasoning_name

CHOICES_METHODS = ("token_length_normalized", "greedy_token_selection",
                   "unconditional_likelihood_normalized")
# `gen(dtype=...)` as SGLang: a regex per type; int and float also stop at whitespace.
DTYPE_REGEXES = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
DTYPE_STOPS: dict[type, tuple[str, ...]] = {int: (" ", "\n"), float: (" ", "\n")}
_DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}


def _caller() -> SourceLocation | None:
    """(file, line) of the code that called into this module (the program's `gen(...)` line)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _schema_text(json_schema: Any) -> str | None:
    if json_schema is None or isinstance(json_schema, str):
        return json_schema
    if isinstance(json_schema, dict):
        return json.dumps(json_schema)
    model_json_schema = getattr(json_schema, "model_json_schema", None)  # pydantic models
    if model_json_schema is not None:
        return json.dumps(model_json_schema())
    raise TypeError("json_schema must be a dict, a JSON string or a pydantic model")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: int | Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: str | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    seed: int | None = None,
    ebnf: str | None = None,
) -> Expr:
    """Generates text into variable `name`. Unset arguments inherit the run's defaults; the
    sampling arguments are `lmnb.params`'s (`max_tokens`, `min_tokens` are SGLang's names for
    `max_new_tokens`, `min_new_tokens`: `lmnb.params.GEN_ARGUMENTS`; `seed` makes sampling
    reproducible). With `choices`, it is a `select`; `dtype` (int, float, bool, str) constrains
    the output as SGLang does (`lmnb.lang.ir.REGEX_*`; int and float also stop at a space or
    newline); `stop_regex` (one or a list) cuts the output before the first match; `regex`,
    `json_schema` or `ebnf` (a grammar whose `root` rule is the output, as SGLang's) constrain
    the output. With
    `return_logprob`, logprobs in `meta_info` are `(logprob, token_id)` pairs, or
    `(logprob, token_id, text)` with `return_text_in_logprobs` (SGLang's triples)."""
    if choices is not None:  # a select; no choices_method: its default, as SGLang's gen
        return select(name, choices, choices_method=choices_method or "token_length_normalized")
    if dtype is not None:
        kind = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if kind not in DTYPE_REGEXES:
            raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
        if regex is not None:
            warnings.warn(f"gen got both dtype and regex; dtype={dtype!r} is used (as SGLang)",
                          stacklevel=2)
        regex = DTYPE_REGEXES[kind]
        if kind in DTYPE_STOPS:
            stop = (*([stop] if isinstance(stop, str) else stop or ()), *DTYPE_STOPS[kind])
    constraints = [n for n, v in (("regex", regex), ("json_schema", json_schema),
                                  ("ebnf", ebnf)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"give at most one of regex, json_schema and ebnf, got "
                         f"{' and '.join(constraints)}")
    if ebnf is not None and not isinstance(ebnf, str):
        raise TypeError(f"ebnf must be a grammar string, got {type(ebnf).__name__}")
    params = GenParams.from_arguments(dict(
        max_tokens=max_tokens, min_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, seed=seed, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        regex=regex, json_schema=_schema_text(json_schema), ebnf=ebnf))
    return Gen(name, params, where=_caller())


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None,
           temperature: float = 0.0,
           choices_method: str = "token_length_normalized") -> Select:
    """Picks one of `choices` by its likelihood after the text so far (no sampling).
    `choices_method` is a method name or one of `lmnb.token_length_normalized`,
    `lmnb.greedy_token_selection`, `lmnb.unconditional_likelihood_normalized`."""
    del temperature  # accepted for SGLang compatibility; scoring is deterministic
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if isinstance(choices, str) or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be a list of non-empty strings, got {choices!r}")
    if not isinstance(choices_method, str) or choices_method not in CHOICES_METHODS:
        raise ValueError(f"unknown choices_method {choices_method!r}; use one of {CHOICES_METHODS}")
    return Select(name, tuple(choices), str(choices_method), where=_caller())


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """SGLang's `separate_reasoning(gen("answer"), model_type="deepseek-r1")`: every named gen and
    select in `expr` keeps only the text after the model's reasoning, and the reasoning goes to
    the variable NAME + "_reasoning_content" (the state's text keeps the answer only). Model
    types: `lmnb.lang.reasoning.FORMATS` (deepseek-r1, qwen3, qwen3-thinking, kimi, ...)."""
    if expr is None:
        raise TypeError("separate_reasoning needs an expression, e.g. separate_reasoning("
                        "gen('answer'), model_type='deepseek-r1')")
    reasoning_format(model_type)  # an unknown model type fails here, at the program's line
    return _with_reasoning(to_expr(expr), str(model_type))


def _with_reasoning(expr: Expr, model_type: str) -> Expr:
    if isinstance(expr, ExprList):
        return ExprList(tuple(_with_reasoning(item, model_type) for item in expr.items))
    if isinstance(expr, Gen | Select):
        reasoning_name(expr.name)  # the reasoning needs a variable name to go to
        return dataclasses.replace(expr, reasoning=model_type)
    return expr


# Parameter names are SGLang's (`image(expr)`, `video(path, num_frames)`, `user(expr)`), so
# that programs passing them by keyword run unchanged.
def image(expr: Any) -> Image:
    return Image(expr)


def video(path: Any, num_frames: int = 8) -> Video:
    return Video(path, num_frames)


def _role(role: str, expr: Any) -> ExprList:
    if expr is None:
        return concat(RoleBegin(role), RoleEnd(role))
    return concat(RoleBegin(role), expr, RoleEnd(role))


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
