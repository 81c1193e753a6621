"""`select()` scoring: which choice a model prefers as the continuation of a prompt.

Every choice is scored over one shared span of tokens. The prompt is tokenized alone and with each
choice appended; the span starts at `start`, the shortest common prefix between the prompt's
tokens and any prompt+choice's tokens. Where a choice's tokenization merges the prompt's last
token (prompt "The sky is " + "red" -> "Ġred" instead of "Ġ" + "red"), the merged token is scored,
and every other choice is scored from the same position, so that all spans cover the same
prompt text (SGLang issues #523, #608, #2873). The prefix `tokens(prompt)[:start]` is prefilled
once, then all choices are scored in one batch.

Methods (`METHODS`), each over the span's conditional logprobs:

- ``token_length_normalized``: the mean logprob; the highest wins.
- ``greedy_token_selection``: what greedy decoding restricted to the choices would pick: at each
  position keep the choices with the highest logprob. A choice that has ended scores -inf at the
  positions after its end, so it loses to any choice that shares its tokens so far and goes on
  (there is no end-of-choice token whose probability could be compared).
- ``unconditional_likelihood_normalized``: the mean of (conditional - unconditional) logprob, where
  the unconditional logprob of each span token comes from the span alone, preceded only by the
  tokens the tokenizer adds to every text (its BOS, if any): this divides out how likely the
  choice's text is without the prompt. Without a BOS the span's first token has no context; it is
  left out of both sums. A choice with no token left scores 0.0 (no evidence either way).

Ties go to the first choice. Positions where choices share all span tokens so far get the first
such choice's logprob, so that noise between batch rows cannot split true ties.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from lmnb.lang.program_error import ProgramError, runtime_abort_message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

METHODS = ("token_length_normalized", "greedy_token_selection",
           "unconditional_likelihood_normalized")

T = TypeVar("T")


class ChoiceScorer(Protocol):
    """What a backend offers to score choices."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model expects (BOS)."""
        ...

    def prompt_logprobs(self, input_ids: list[list[int]], start: int) -> list[list[float]]:
        """Per sequence, the logprob of each token at positions `start`.. given the tokens before
        it. Position 0 has none, so `start >= 1`; every sequence is longer than `start`."""
        ...

    def cache_prefix(self, input_ids: list[int]) -> None:
        """Hint: `input_ids` is a prefix of the sequences about to be scored."""
        ...

    def unconditional_context(self) -> list[int]:
        """Tokens standing for "no context": what the tokenizer puts before any text (BOS), or a
        start-of-text token when it puts nothing there."""
        ...


@runtime_checkable
class TokenTextScorer(Protocol):
    """A `ChoiceScorer`'s optional extra: the text of one token, for the meta_info's SGLang-style
    `(logprob, token_id, text)` triples (None there where a scorer has no tokenizer)."""

    def token_text(self, token_id: int) -> str: ...


@dataclass
class ChoiceResult:
    choice: str
    index: int
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Spans:
    start: int  # first scored token position, shared by all choices
    token_ids: list[list[int]]  # per choice, tokens(prompt + choice)[start:]
    logprobs: list[list[float]]  # per choice, conditional logprob of each span token


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _share_ties(token_ids: list[list[int]], values: list[list[T]]) -> list[list[T]]:
    """Gives choices sharing span tokens [0..j] the same value at j (the first such choice's)."""
    first: dict[tuple[int, ...], T] = {}
    shared = []
    for ids, row in zip(token_ids, values, strict=True):
        shared.append([first.setdefault(tuple(ids[:j + 1]), v) for j, v in enumerate(row)])
    return shared


def _argmax(scores: Sequence[float]) -> int:
    best = 0
    for i, score in enumerate(scores):
        if score > scores[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _token_length_normalized(scorer: ChoiceScorer, spans: _Spans,
                             meta: dict[str, Any]) -> int:
    return _argmax(meta["normalized_prompt_logprobs"])


def _greedy_token_selection(scorer: ChoiceScorer, spans: _Spans, meta: dict[str, Any]) -> int:
    width = max(len(row) for row in spans.logprobs)
    matrix = [row + [-math.inf] * (width - len(row)) for row in spans.logprobs]
    meta["greedy_logprob_matrix"] = matrix
    remaining = list(range(len(matrix)))
    for j in range(width):
        best = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == best]
        if len(remaining) == 1:
            break
    return remaining[0]


def _unconditional_likelihood_normalized(scorer: ChoiceScorer, spans: _Spans,
                                         meta: dict[str, Any]) -> int:
    context = scorer.unconditional_context()
    first = max(len(context), 1)  # the first position that has a logprob
    skip = first - len(context)  # span tokens before any context: 1 without BOS, else 0
    sequences = [context + ids for ids in spans.token_ids]
    scored = [i for i, seq in enumerate(sequences) if len(seq) > first]
    results = scorer.prompt_logprobs([sequences[i] for i in scored], first) if scored else []
    unconditional: list[list[float | None]] = [[None] * len(ids) for ids in spans.token_ids]
    for i, values in zip(scored, results, strict=True):
        _check_lengths(values, len(spans.token_ids[i]) - skip)
        unconditional[i][skip:] = values
    unconditional = _share_ties(spans.token_ids, unconditional)
    scores = []
    for conditional, prior in zip(spans.logprobs, unconditional, strict=True):
        diffs = [c - u for c, u in zip(conditional, prior, strict=True) if u is not None]
        scores.append(_mean(diffs) if diffs else 0.0)
    meta["unconditional_token_logprobs"] = _triples(scorer, unconditional, spans.token_ids)
    meta["normalized_unconditional_prompt_logprobs"] = scores
    return _argmax(scores)


_METHODS: dict[str, Callable[[ChoiceScorer, _Spans, dict[str, Any]], int]] = {
    "token_length_normalized": _token_length_normalized,
    "greedy_token_selection": _greedy_token_selection,
    "unconditional_likelihood_normalized": _unconditional_likelihood_normalized,
}


def _triples(scorer: ChoiceScorer, logprobs: list[list[Any]],
             token_ids: list[list[int]]) -> list[list[tuple[Any, int, str | None]]]:
    """Per choice, SGLang's `(logprob, token_id, text)` triples."""
    token_text = scorer.token_text if isinstance(scorer, TokenTextScorer) else None
    return [[(logprob, token, None if token_text is None else token_text(token))
             for logprob, token in zip(row, ids, strict=True)]
            for row, ids in zip(logprobs, token_ids, strict=True)]


def _check_lengths(values: Sequence[float], expected: int) -> None:
    if len(values) != expected:
        raise RuntimeError(f"the scorer returned {len(values)} logprobs, expected {expected}")


def _spans(scorer: ChoiceScorer, prompt: str, choices: Sequence[str]) -> _Spans:
    prompt_ids = scorer.encode(prompt)
    full = [scorer.encode(prompt + choice) for choice in choices]
    start = min(_common_prefix_length(prompt_ids, ids) for ids in full)
    if start < 1:
        raise ValueError("select needs a prompt that the choices' tokens can be scored after: "
                         f"{prompt!r} gives no token shared by all prompt+choice tokenizations")
    token_ids = [ids[start:] for ids in full]
    for choice, ids in zip(choices, token_ids, strict=True):
        if not ids:
            raise ValueError(f"choice {choice!r} adds no tokens to the prompt")
    scorer.cache_prefix(prompt_ids[:start])
    logprobs = scorer.prompt_logprobs(full, start)
    for values, ids in zip(logprobs, token_ids, strict=True):
        _check_lengths(values, len(ids))
    shared = _share_ties(token_ids, [list(map(float, values)) for values in logprobs])
    return _Spans(start, token_ids, shared)


def select_choice(scorer: ChoiceScorer, prompt: str, choices: Sequence[str],
                  method: str = "token_length_normalized") -> ChoiceResult:
    """Picks the choice the model prefers after `prompt`, scored by `method` (one of
    `METHODS`). `meta_info` has SGLang's fields: `normalized_prompt_logprobs` (per choice),
    `input_token_logprobs` (per choice, `(logprob, token_id, text)` over the scored span),
    `output_token_logprobs` (per choice, empty: nothing is generated), and the method's own
    (`greedy_logprob_matrix`; `unconditional_token_logprobs` and
    `normalized_unconditional_prompt_logprobs`); and lmnb's `method`, `scored_from` (the span's
    first token position) and `input_token_ids`."""
    if method not in _METHODS:
        raise ValueError(f"unknown choices method {method!r}; use one of {METHODS}")
    if isinstance(choices, str) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(choice, str) for choice in choices):
        raise ValueError(f"select choices must be strings, got {list(choices)!r}")
    choices = list(choices)
    spans = _spans(scorer, prompt, choices)
    meta: dict[str, Any] = {
        "method": method,
        "scored_from": spans.start,
        "normalized_prompt_logprobs": [_mean(values) for values in spans.logprobs],
        "input_token_logprobs": _triples(scorer, spans.logprobs, spans.token_ids),
        "output_token_logprobs": [[] for _ in choices],
        "input_token_ids": spans.token_ids,
    }
    index = _METHODS[method](scorer, spans, meta)
    return ChoiceResult(choice=choices[index], index=index, meta_info=meta)


class ScoringRuntime(Protocol):
    """What `RuntimeChoiceScorer` calls of a runtime: an `lmnb.Runtime` itself, or an adapter
    with these calls (the program loop's `AwaitedRuntime`, an endpoint's scoring client)."""

    tokenizer: PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]: ...

    def generate(self, *, input_ids: list[list[int]], sampling_params: dict[str, Any],
                 **options: Any) -> Any: ...  # a result dict per sequence (a list)

    def cache_prefix(self, *, input_ids: list[int]) -> Any: ...


class RuntimeChoiceScorer:
    """`ChoiceScorer` over an in-process `lmnb.Runtime` (or a client with its `generate`).

    With media (`media={"image_data": [...], "video_data": [...]}` for a prompt with images or
    videos, and their token ids `media_token_ids`), the sequences that hold those tokens are sent
    with the media; the runtime expands each media token into its span, so positions past it
    shift by the spans' length, which `cache_prefix` of the shared prefix measures
    (`prompt_tokens` minus the ids sent) before any sequence is scored."""

    def __init__(self, runtime: ScoringRuntime, *, media: dict[str, list[Any]] | None = None,
                 media_token_ids: frozenset[int] = frozenset()) -> None:
        self.runtime = runtime
        self.media = {key: list(value) for key, value in (media or {}).items() if value}
        self.media_token_ids = frozenset(media_token_ids)
        self._shift: int | None = None  # how far the media spans move later positions

    def encode(self, text: str) -> list[int]:
        return self.runtime.encode(text)

    def token_text(self, token_id: int) -> str:
        return self.runtime.tokenizer.decode([token_id])

    def unconditional_context(self) -> list[int]:
        ids = self.encode("")
        if ids:
            return ids
        tokenizer = self.runtime.tokenizer
        start = tokenizer.bos_token_id
        if start is None:
            start = tokenizer.eos_token_id
        return [] if start is None else [start]

    def _has_media(self, ids: list[int]) -> bool:
        return bool(self.media) and any(t in self.media_token_ids for t in ids)

    def _media_kwargs(self, count: int) -> dict[str, Any]:
        """`image_data=` / `video_data=` for `count` prompts that each hold all the media."""
        return {key: [list(value) for _ in range(count)] for key, value in self.media.items()}

    def prompt_logprobs(self, input_ids: list[list[int]], start: int) -> list[list[float]]:
        with_media = [i for i, ids in enumerate(input_ids) if self._has_media(ids)]
        plain = [i for i in range(len(input_ids)) if i not in set(with_media)]
        results: dict[int, list[float]] = {}
        for group, shift in ((plain, 0), (with_media, None)):
            if not group:
                continue
            if shift is None:
                if self._shift is None:  # what cache_prefix measures
                    self.cache_prefix(input_ids[group[0]][:start])
                shift = self._shift or 0
            extra = self._media_kwargs(len(group)) if group is with_media else {}
            outputs = self.runtime.generate(
                input_ids=[list(input_ids[i]) for i in group],
                sampling_params={"max_new_tokens": 0}, return_logprob=True,
                logprob_start_len=start + shift, **extra)
            for i, output in zip(group, outputs, strict=True):
                if (message := runtime_abort_message(output["meta_info"])) is not None:
                    raise ProgramError(f"the runtime aborted a select's scoring request: "
                                       f"{message}")
                pairs = output["meta_info"]["input_token_logprobs"]
                if [token for _, token in pairs] != list(input_ids[i][start:]):
                    raise RuntimeError("the runtime's prompt logprobs do not match the tokens "
                                       "sent")
                results[i] = [float(logprob) for logprob, _ in pairs]
        return [results[i] for i in range(len(input_ids))]

    def cache_prefix(self, input_ids: list[int]) -> None:
        if not self._has_media(input_ids):
            self.runtime.cache_prefix(input_ids=list(input_ids))
            return
        out = self.runtime.generate(input_ids=[list(input_ids)],
                                    sampling_params={"max_new_tokens": 0},
                                    **self._media_kwargs(1))[0]
        self._shift = int(out["meta_info"]["prompt_tokens"]) - len(input_ids)


class ChoicesMethod(str):
    """A choices method by name, importable as in SGLang (`lmnb.greedy_token_selection`): a `str`
    (accepted wherever a method name is) that also scores: `method(scorer, prompt, choices)`."""

    __slots__ = ()

    def __new__(cls, name: str) -> ChoicesMethod:
        if name not in _METHODS:
            raise ValueError(f"unknown choices method {name!r}; use one of {METHODS}")
        return super().__new__(cls, name)

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return self == "unconditional_likelihood_normalized"

    def __call__(self, scorer: ChoiceScorer, prompt: str, choices: Sequence[str]) -> ChoiceResult:
        return select_choice(scorer, prompt, choices, str(self))

    def __repr__(self) -> str:
        return f"ChoicesMethod({str(self)!r})"


token_length_normalized = ChoicesMethod("token_length_normalized")
greedy_token_selection = ChoicesMethod("greedy_token_selection")
unconditional_likelihood_normalized = ChoicesMethod("unconditional_likelihood_normalized")
