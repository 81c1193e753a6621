"""The checks of a generate call that the in-process `Runtime` and the `DataParallelRuntime`
share: per-prompt sampling parameters, the logprob options, and each prompt against the
vocabulary and the context length. Both raise the same `InvalidRequestError`s, before any work
is submitted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmnb.multimodal.items import MultimodalInputs
from lmnb.params import ContextLengthError, InvalidRequestError, SamplingParams
from lmnb.runtime.media_requests import check_prompt_ids
from lmnb.runtime.output.stop import within_context

SamplingInput = dict[str, Any] | Sequence[dict[str, Any]] | None
# SGLang's token_ids_logprob: ids for every prompt, or (a list of prompts) a list per prompt
TokenIdsInput = Sequence[int] | Sequence[Sequence[int] | None] | None
# SGLang's return_logprob / logprob_start_len / top_logprobs_num: one value for every prompt, or
# (a list of prompts) one per prompt
LogprobFlagInput = bool | Sequence[bool]
LogprobCountInput = int | Sequence[int | None] | None


def _check_count(sampling_params: SamplingInput, count: int) -> bool:
    """Whether `sampling_params` is a per-prompt list (then one entry per prompt)."""
    if not isinstance(sampling_params, list | tuple):
        return False
    if len(sampling_params) != count:
        raise InvalidRequestError(f"{len(sampling_params)} sampling_params for {count} prompts")
    return True


def params_list(sampling_params: SamplingInput, count: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt; one dict for all is parsed once and shared (the
    runtime never mutates a request's parameters), and so is a run of equal dicts in a list."""
    if _check_count(sampling_params, count):
        parsed: list[SamplingParams] = []
        previous: Any = None
        for p in sampling_params:  # type: ignore[union-attr]
            if parsed and same_dict(p, previous):
                parsed.append(parsed[-1])
            else:
                parsed.append(SamplingParams.from_dict(dict(p) if isinstance(p, dict) else p))
            previous = p
        return parsed
    params = dict(sampling_params) if isinstance(sampling_params, dict) else sampling_params
    return [SamplingParams.from_dict(params)] * count  # type: ignore[arg-type]


def same_dict(a: object, b: object) -> bool:
    """`a` and `b` are equal dicts written the same way (16 and 16.0, or [16] and [16.0], are
    equal, but only one of each is valid)."""
    return isinstance(a, dict) and isinstance(b, dict) and a == b and repr(a) == repr(b)


def params_dicts(sampling_params: SamplingInput, count: int) -> list[dict[str, Any]]:
    """One dict per prompt (a copy; None is `{}`), as a request to another process carries
    them; not yet parsed (`params_list` of the result checks them)."""
    if _check_count(sampling_params, count):
        return [dict(p or {}) for p in sampling_params]  # type: ignore[union-attr]
    return [dict(sampling_params or {}) for _ in range(count)]  # type: ignore[arg-type]


def logprob_options(return_logprob: bool, logprob_start_len: int | None,
                    top_logprobs_num: int | None, *, vocab_size: int) -> tuple[int, int]:
    """(logprob_start_len, top_logprobs_num) as requests carry them, checked."""
    start = -1 if logprob_start_len is None else logprob_start_len
    top = top_logprobs_num or 0
    for name, value in (("logprob_start_len", start), ("top_logprobs_num", top)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    if top < 0 or top > vocab_size:
        raise InvalidRequestError(f"top_logprobs_num must be in [0, {vocab_size}], got {top}")
    return (start, top) if return_logprob else (-1, 0)


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """One prompt's logprob options as its requests carry them (`logprob_options`')."""

    return_logprob: bool
    start: int  # logprob_start_len; -1: the output's only
    top: int  # top_logprobs_num


def logprob_options_per_prompt(return_logprob: LogprobFlagInput,
                               logprob_start_len: LogprobCountInput,
                               top_logprobs_num: LogprobCountInput, *, count: int,
                               is_batch: bool, vocab_size: int,
                               always: bool = False) -> list[LogprobOptions]:
    """Per prompt its options, checked: each of SGLang's three fields one value for every prompt
    or, for a list of prompts, a list with one per prompt. `always` (token origins, which imply
    them) asks every prompt for logprobs."""
    flags, starts, tops = (_per_prompt(name, value, count, is_batch) for name, value in (
        ("return_logprob", return_logprob), ("logprob_start_len", logprob_start_len),
        ("top_logprobs_num", top_logprobs_num)))
    out = []
    for flag, start, top in zip(flags, starts, tops, strict=True):
        flag = bool(flag) or always
        out.append(LogprobOptions(flag, *logprob_options(flag, start, top,
                                                         vocab_size=vocab_size)))
    return out


def logprob_requests(return_logprob: LogprobFlagInput, logprob_start_len: LogprobCountInput,
                     top_logprobs_num: LogprobCountInput, token_ids_logprob: TokenIdsInput, *,
                     count: int, is_batch: bool, vocab_size: int, always: bool = False
                     ) -> tuple[list[LogprobOptions], list[list[int] | None]]:
    """`generate`'s logprob arguments, checked, per prompt: its options
    (`logprob_options_per_prompt`) and the ids it names (`token_ids_option`)."""
    logprobs = logprob_options_per_prompt(return_logprob, logprob_start_len, top_logprobs_num,
                                          count=count, is_batch=is_batch,
                                          vocab_size=vocab_size, always=always)
    token_ids = token_ids_option(token_ids_logprob,
                                 return_logprob=[options.return_logprob for options in logprobs],
                                 count=count, is_batch=is_batch, vocab_size=vocab_size)
    return logprobs, token_ids


def _per_prompt(name: str, value: Any, count: int, is_batch: bool) -> list[Any]:
    if not isinstance(value, list | tuple):
        return [value] * count
    if not is_batch:
        raise InvalidRequestError(f"{name}: a list gives one value per prompt of a list of "
                                  f"prompts; this request has one prompt")
    if len(value) != count:
        raise InvalidRequestError(f"{name} has {len(value)} values for {count} prompts")
    return list(value)


def token_ids_option(token_ids_logprob: TokenIdsInput, *, return_logprob: bool | Sequence[bool],
                     count: int, is_batch: bool, vocab_size: int) -> list[list[int] | None]:
    """Per prompt the ids whose logprobs it reports at every scored position (SGLang's
    `token_ids_logprob`), checked: None or [] for none; a list of ids for every prompt; for a
    list of prompts also one list (or None) per prompt. None for a prompt without
    `return_logprob` (one flag for all, or one per prompt)."""
    if token_ids_logprob is None or (isinstance(token_ids_logprob, list | tuple)
                                     and len(token_ids_logprob) == 0):
        return [None] * count
    if not isinstance(token_ids_logprob, list | tuple):
        raise InvalidRequestError(
            f"token_ids_logprob must be a list of token ids, got {token_ids_logprob!r}")
    if all(_is_int(item) for item in token_ids_logprob):
        per_prompt: Sequence[Any] = [token_ids_logprob] * count
    elif is_batch and all(item is None or isinstance(item, list | tuple)
                          for item in token_ids_logprob):
        if len(token_ids_logprob) != count:
            raise InvalidRequestError(
                f"{len(token_ids_logprob)} token_ids_logprob lists for {count} prompts")
        per_prompt = token_ids_logprob
    else:
        shape = "a list of token ids" + (" or one list per prompt" if is_batch else "")
        raise InvalidRequestError(f"token_ids_logprob must be {shape}, got {token_ids_logprob!r}")
    flags = (list(return_logprob) if isinstance(return_logprob, Sequence)
             else [return_logprob] * count)
    out: list[list[int] | None] = []
    for ids, flag in zip(per_prompt, flags, strict=True):
        for token in ids or ():
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"token_ids_logprob: {token!r} is not a token id in [0, {vocab_size})")
        out.append(list(ids) if ids and flag else None)
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _media_note(mm_inputs: MultimodalInputs) -> str:
    """How much of a too-long prompt its media take."""
    items = mm_inputs.items
    counts = ", ".join(f"{sum(i.kind == k for i in items)} {k}(s)"
                       for k in ("image", "video") if any(i.kind == k for i in items))
    return (f" ({sum(i.num_tokens for i in items)} of them for {counts};"
            " fewer or smaller media, or fewer frames, would fit)")


def check_prompt(ids: list[int], params: SamplingParams, *, context_len: int, vocab_size: int,
                 logprob_start: int, mm_inputs: MultimodalInputs | None = None,
                 ids_trusted: bool = False, allow_auto_truncate: bool = False) -> SamplingParams:
    """Raises `InvalidRequestError` for a prompt that cannot be served: one of `context_len`
    tokens or more, or (as SGLang's and vLLM's servers) one whose max_new_tokens does not fit
    in the room it leaves unless `allow_auto_truncate` (SGLang's option: max_new_tokens is cut
    to the room instead). Returns `params` with max_new_tokens None (no limit) made the room.
    `ids_trusted`: the ids come from a tokenizer whose ids all fit the vocabulary (no range
    check needed); `logprob_start` as `logprob_options` returns it."""
    if not ids:
        raise InvalidRequestError("empty prompt: it has no tokens")
    if mm_inputs is not None or not ids_trusted:
        check_prompt_ids(ids, mm_inputs, vocab_size)
    prompt_len, wanted = len(ids), params.max_new_tokens
    if prompt_len >= context_len:
        media = "" if mm_inputs is None else _media_note(mm_inputs)
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens{media}, but this model's maximum context "
            f"length is {context_len} tokens (a prompt must leave room for one new token)",
            prompt_tokens=prompt_len, max_new_tokens=None, context_len=context_len)
    if wanted is not None and prompt_len + wanted > context_len and not allow_auto_truncate:
        # vLLM's OpenAI server's words, which clients parse for the three numbers
        raise ContextLengthError(
            f"This model's maximum context length is {context_len} tokens. However, you "
            f"requested {prompt_len + wanted} tokens ({prompt_len} in the messages, {wanted} "
            f"in the completion). Reduce the prompt or the new tokens asked for: at most "
            f"{context_len - prompt_len} fit after this prompt",
            prompt_tokens=prompt_len, max_new_tokens=wanted, context_len=context_len)
    if logprob_start >= prompt_len:
        raise InvalidRequestError(
            f"logprob_start_len {logprob_start} is past the prompt's {prompt_len} tokens")
    if params.logit_bias:
        outside = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias: token id(s) {outside[:8]} not in the vocabulary [0, {vocab_size})",
                param="logit_bias")
    return within_context(params, prompt_len=prompt_len, context_len=context_len)
