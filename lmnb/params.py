"""THE sampling parameters: names, defaults, one-line descriptions and validation.

One definition serves the runtime (requests), the DSL (`gen` arguments and run defaults), the
magics' help and the server. Names and defaults follow SGLang's `sampling_params`. No torch here:
`import lmnb.params` must stay light.

Every name of SGLang 0.5's `SamplingParams` is accepted: lmnb's fields, `sampling_seed` (SGLang's
name of `seed`), and the ones lmnb does not implement (`UNSUPPORTED_SAMPLING_PARAMS`), which pass
only with their default (or an equivalent) value and are refused by name otherwise. As in SGLang,
None stands for a field's default.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, NoReturn


class InvalidRequestError(ValueError):
    """A request that cannot be served as given; raised to the caller, the runtime is untouched.
    `param`: the request field it is about, when one is (the OpenAI error body's `param`)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt of `prompt_tokens` that with the `max_new_tokens` it asks for (None: the prompt
    alone) does not fit in the `context_len` tokens of the model's context. The servers give
    it their API's words and error code."""

    def __init__(self, message: str, *, prompt_tokens: int, max_new_tokens: int | None,
                 context_len: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self.context_len = context_len


TOP_K_ALL = -1
# What a torch.Generator takes as a seed; sample i of a request is seeded with seed + i.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def stop_regex_patterns(value: str | Sequence[str] | None) -> list[str]:
    """`stop_regex` as a list of patterns (a string is one pattern; empty ones are dropped),
    each checked with `re.compile`."""
    if not isinstance(value, str | list | tuple | None):
        raise InvalidRequestError("invalid sampling params: stop_regex must be a string or "
                                  f"a list of strings, got {value!r}")
    patterns = [value] if isinstance(value, str) else list(value or [])
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise InvalidRequestError("invalid sampling params: stop_regex must be a string or "
                                      f"a list of strings, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as error:
            message = f"stop_regex {pattern!r} is not a regex: {error}"
            raise InvalidRequestError(f"invalid sampling params: {message}") from None
    return [p for p in patterns if p]


def _invalid(message: str) -> NoReturn:
    raise InvalidRequestError(f"invalid sampling params: {message}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding parameters, validated on construction (`InvalidRequestError`)."""

    max_new_tokens: int | None = 128  # None: up to the context length (SGLang's)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None  # an EBNF grammar (xgrammar's GBNF dialect); its `root` is the output
    # SGLang's and OpenAI's: token id -> added to its logit before sampling ({} is None)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, single in (("stop", str), ("stop_token_ids", int)):
            value = getattr(self, name)
            if not isinstance(value, list | tuple | single | None):
                raise InvalidRequestError(f"invalid sampling params: {name} must be a list, "
                                          f"got {value!r}")
        self.stop = [s for s in (self.stop or []) if s]
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = [self.stop_token_ids]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_regex = stop_regex_patterns(self.stop_regex)
        if self.top_k in (0, None):
            self.top_k = TOP_K_ALL
        self.logit_bias = logit_bias_entries(self.logit_bias)
        self._check()

    def _check(self) -> None:
        # Each message is formatted only when its check fails (a request's parameters are
        # parsed on the caller's path to the first pass).
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (value is None or (isinstance(value, int) and not isinstance(value, bool))):
                _invalid(f"{name} must be an int, got {value!r}")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                    and not math.isinf(value)):
                _invalid(f"{name} must be a finite number, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _invalid(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (self.regex is None or isinstance(self.regex, str)):
            _invalid(f"regex must be a string, got {self.regex!r}")
        if not (self.json_schema is None or isinstance(self.json_schema, str | dict)):
            _invalid(f"json_schema must be a string or a dict, got {self.json_schema!r}")
        if not (self.max_new_tokens is None or self.max_new_tokens >= 0):
            _invalid(f"max_new_tokens must be an int >= 0 or None, got {self.max_new_tokens!r}")
        if not (self.min_new_tokens is not None and 0 <= self.min_new_tokens):
            _invalid(f"min_new_tokens must be an int >= 0, got {self.min_new_tokens!r}")
        if not (self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens):
            _invalid(f"min_new_tokens ({self.min_new_tokens}) > max_new_tokens "
                     f"({self.max_new_tokens})")
        if not self.temperature >= 0.0:
            _invalid(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _invalid(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == TOP_K_ALL or self.top_k >= 1):
            _invalid(f"top_k must be -1 (all) or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            _invalid(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _invalid(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _invalid(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            _invalid(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not self.n >= 1:
            _invalid(f"n must be an int >= 1, got {self.n!r}")
        if not all(isinstance(s, str) for s in self.stop):
            _invalid("stop must be a string or list of strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            _invalid("stop_token_ids must be a list of ints")
        if not (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)):
            _invalid(f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (seed + n - 1 "
                     f"seeds the last sample, at most {SEED_MAX}), got {self.seed}")
        if not (self.ebnf is None or (isinstance(self.ebnf, str) and bool(self.ebnf.strip()))):
            _invalid(f"ebnf must be a non-empty grammar string, got {self.ebnf!r}")
        constraints = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(constraints) > 1:
            _invalid(f"give at most one of regex, json_schema and ebnf, got "
                     f"{' and '.join(constraints)}")

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Parameters from a request's dict (SGLang's `sampling_params`): None values mean the
        default (but max_new_tokens None: up to the context length), `sampling_seed` is `seed`,
        an unsupported SGLang parameter passes only with its default; unknown keys are rejected
        with the list of known ones."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"sampling_params must be a dict, got {type(params).__name__}")
        unknown = sorted(set(params) - set(ACCEPTED_SAMPLING_PARAM_NAMES))
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling params {unknown}; known: "
                f"{sorted(ACCEPTED_SAMPLING_PARAM_NAMES)}")
        values = _with_aliases_resolved(params)
        for name, accepted in UNSUPPORTED_SAMPLING_PARAMS.items():
            if name in values:
                _check_unsupported(name, values.pop(name), accepted)
        values = {k: v for k, v in values.items() if v is not None or k in _NONE_KEPT}
        try:
            return cls(**values)
        except TypeError as error:
            raise InvalidRequestError(f"invalid sampling params: {error}") from None

    @classmethod
    def merged(cls, defaults: Mapping[str, Any],
               overrides: Mapping[str, Any] | None = None) -> SamplingParams:
        """A request's parameters from partial settings (SamplingParams' names): `overrides`
        over `defaults` by `merged_params`, the rest at their defaults; validated (and tuples
        taken for lists) as by `from_dict`."""
        return cls.from_dict(merged_params(defaults, overrides or {}))

    def to_dict(self) -> dict[str, Any]:
        """Every field in a new dict (lists and dicts copied): `Runtime.generate`'s
        `sampling_params`."""
        values = {name: getattr(self, name) for name in SAMPLING_PARAM_NAMES}
        return {name: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                for name, v in values.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)


SAMPLING_PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "seed")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")
# None kept by `from_dict`: the fields whose default is None, and max_new_tokens (None: up to
# the context length, as SGLang's)
_NONE_KEPT = frozenset({"max_new_tokens", *(f.name for f in fields(SamplingParams)
                                            if f.default is None)})

# SGLang's names for lmnb's parameters: {SGLang's name: lmnb's}.
SAMPLING_PARAM_ALIASES: Mapping[str, str] = MappingProxyType({"sampling_seed": "seed"})

# SGLang 0.5's sampling parameters that lmnb does not implement: {name: the values that ask for
# nothing (its default first, then equivalents)}. Any other value is refused, naming the field.
# None and an empty dict also mean "not used".
UNSUPPORTED_SAMPLING_PARAMS: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "beam_width": (None, 1),  # 1 is plain sampling
    "structural_tag": (None,),
    "spaces_between_special_tokens": (True,),
    "no_stop_trim": (False,),
    "stream_interval": (None, 1),  # lmnb streams every step's tokens
    "custom_params": (None,),
    "watermark": (None,),
})

ACCEPTED_SAMPLING_PARAM_NAMES: tuple[str, ...] = (
    SAMPLING_PARAM_NAMES + tuple(SAMPLING_PARAM_ALIASES) + tuple(UNSUPPORTED_SAMPLING_PARAMS))


def _with_aliases_resolved(params: dict[str, Any]) -> dict[str, Any]:
    values = dict(params)
    for alias, name in SAMPLING_PARAM_ALIASES.items():
        if alias not in values:
            continue
        value = values.pop(alias)
        if value is None:
            continue
        if values.get(name) is not None and values[name] != value:
            raise InvalidRequestError(f"invalid sampling params: {alias} ({value!r}) and {name} "
                                      f"({values[name]!r}) differ; give one")
        values[name] = value
    return values


def _check_unsupported(name: str, value: Any, accepted: tuple[Any, ...]) -> None:
    unused = value is None or (isinstance(value, dict) and not value)
    if not unused and not any(value == a and type(value) is type(a) for a in accepted
                              if a is not None):
        shown = " or ".join(repr(a) for a in accepted)
        raise InvalidRequestError(f"unsupported sampling param {name}={value!r}: lmnb does not "
                                  f"implement {name}; leave it out or give {shown}")


_TOKEN_ID = re.compile(r"-?[0-9]+")


def logit_bias_entries(value: Any) -> dict[int, float] | None:
    """`logit_bias` as {token id: bias}, checked: keys are ints or strings of one (JSON's), at
    most once each; values finite numbers, added as given (SGLang does not clamp them; vLLM
    clamps to OpenAI's [-100, 100]). None or {} is None. Ids are checked against the
    vocabulary when a request is made (`request_checks.check_prompt`)."""
    if value is None:
        return None

    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid sampling params: logit_bias {message}",
                                   param="logit_bias")

    if not isinstance(value, Mapping):
        raise bad(f"must be an object of token id -> bias, got {value!r}")
    entries: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, int) and not isinstance(key, bool):
            token = key
        elif isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token = int(key)
        else:
            raise bad(f"keys must be token ids (ints, or strings of one), got {key!r}")
        if token in entries:
            raise bad(f"names token {token} twice")
        if not (isinstance(bias, numbers.Real) and not isinstance(bias, bool)
                and math.isfinite(bias)):
            raise bad(f"values must be finite numbers, got {bias!r} for token {token}")
        entries[token] = float(bias)
    return entries or None


def merged_params(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """THE merge of partial parameter settings (a run's defaults, a gen's arguments): the set
    values of `defaults` with the set values of `overrides` on top. None (or absent) is unset."""
    merged = {name: value for name, value in defaults.items() if value is not None}
    merged.update((name, value) for name, value in overrides.items() if value is not None)
    return merged


def default_sampling_params() -> dict[str, Any]:
    """Every sampling parameter's default, in a new dict (its lists are new too)."""
    defaults = SamplingParams()
    return {name: getattr(defaults, name) for name in SAMPLING_PARAM_NAMES}


# Logprob options travel beside the sampling parameters (SGLang's `generate` arguments).
LOGPROB_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
     "return_text_in_logprobs": False})
LOGPROB_PARAM_NAMES: tuple[str, ...] = tuple(LOGPROB_DEFAULTS)

# THE table of the DSL's names: each `gen(...)` keyword (SGLang frontend's names) and the
# parameter it sets (SamplingParams' name, or a logprob option's). Only these two differ.
GEN_ARGUMENTS: Mapping[str, str] = MappingProxyType({
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
    **{name: name for name in (
        "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "seed", "ignore_eos", "regex", "json_schema",
        "ebnf", *LOGPROB_PARAM_NAMES)},
})

# One line per parameter (sampling and logprob options), for help texts.
PARAM_HELP: dict[str, str] = {
    "max_new_tokens": "most tokens to generate",
    "min_new_tokens": "fewest tokens to generate before EOS or a stop may end the output",
    "temperature": "softmax temperature; 0 is greedy",
    "top_p": "sample from the smallest set of tokens whose probability reaches top_p",
    "top_k": "sample from the k most likely tokens; -1 is all",
    "min_p": "drop tokens less likely than min_p times the most likely one",
    "frequency_penalty": "subtract this times a token's count in the output so far (-2 to 2)",
    "presence_penalty": "subtract this from tokens already in the output (-2 to 2)",
    "repetition_penalty": "scale logits of tokens seen in prompt or output; > 1 discourages them",
    "stop": "strings that end the output (not included in it)",
    "stop_token_ids": "token ids that end the output",
    "stop_regex": "regexes whose first match ends the output (cut before it)",
    "ignore_eos": "keep generating after the end-of-sequence token",
    "skip_special_tokens": "leave special tokens out of the text",
    "n": "number of samples of the same prompt",
    "seed": "random seed of this request's sampling (sample i uses seed + i)",
    "regex": "the output must match this regex",
    "json_schema": "the output must be JSON valid under this schema",
    "ebnf": "the output must be in this EBNF grammar's language (root rule `root`)",
    "logit_bias": "token id -> number added to that token's logit before sampling",
    "return_logprob": "return the log-probabilities of prompt and output tokens",
    "logprob_start_len": "first prompt position whose logprob is returned; -1 is none",
    "top_logprobs_num": "also return this many most likely tokens at each position",
    "return_text_in_logprobs": "logprobs as (logprob, token id, token text)",
}


def param_help(name: str) -> str:
    """`name`'s description with its default, e.g. for a command-line option's help."""
    default = {**default_sampling_params(), **LOGPROB_DEFAULTS}[name]
    return f"{PARAM_HELP[name]} (default {default!r})"
