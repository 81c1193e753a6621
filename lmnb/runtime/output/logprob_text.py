"""Logprob lists with the tokens' text: SGLang's `return_text_in_logprobs`.

The runtime reports logprobs as `(logprob, token_id)` pairs (`meta_info`'s
`input_token_logprobs`, `output_token_logprobs`) and rows of them (`input_top_logprobs`,
`output_top_logprobs`, and of the ids a request named, `input_token_ids_logprobs`,
`output_token_ids_logprobs`; a row may be None: the first prompt token has no logprob); a
streamed running chunk has the output's new rows under `new_*` keys instead. With
the text, each pair becomes a `(logprob, token_id, text)` triple, the text being the token
decoded alone with its special tokens kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmnb.runtime.output.detokenizer import Decoder, single_token_texts
from lmnb.runtime.output.logprob_lists import LISTS

# each with the output's list and a running chunk's new rows of it (`logprob_lists.LISTS`)
TOKEN_LOGPROB_KEYS = ("input_token_logprobs", *LISTS["input_token_logprobs"])
# rows of pairs: the top logprobs, and those of the ids a request named (`token_ids_logprob`)
TOP_LOGPROB_KEYS = ("input_top_logprobs", *LISTS["input_top_logprobs"],
                    "input_token_ids_logprobs", *LISTS["input_token_ids_logprobs"])


class TokenTexts:
    """Token id -> its text, cached per tokenizer (the same ids recur across rows, requests
    and program runs: a token view's top-k alternatives are mostly ids seen before; the cache
    is `single_token_texts`', which detokenizers keeping special tokens share)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._cache = single_token_texts(tokenizer, skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text


def with_token_texts(meta: dict[str, Any],
                     text_of: Callable[[int], str | None]) -> dict[str, Any]:
    """`meta` (not changed) with its logprob pairs as `(logprob, token_id, text_of(token_id))`
    triples; items that are triples already keep their text."""

    def triple(item: Any) -> tuple[Any, int, str | None]:
        logprob, token_id = item[0], item[1]
        return logprob, token_id, item[2] if len(item) > 2 else text_of(token_id)

    out = dict(meta)
    for key in TOKEN_LOGPROB_KEYS:
        if out.get(key) is not None:
            out[key] = [triple(item) for item in out[key]]
    for key in TOP_LOGPROB_KEYS:
        if out.get(key) is not None:
            out[key] = [None if row is None else [triple(item) for item in row]
                        for row in out[key]]
    return out
