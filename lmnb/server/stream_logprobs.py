"""The output logprobs of streamed choices a chunk at a time: OpenAI's chunks carry those of
their own new tokens (as vLLM's and SGLang's do), not all of them in a choice's last chunk.
`chat_logprobs`: OpenAI's chat entries `{token, logprob, bytes, top_logprobs}`, which Ollama's
`logprobs` share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmnb.runtime.fsm.token_bytes import token_byte_table
from lmnb.runtime.output.logprob_lists import OutputLists
from lmnb.runtime.output.logprob_text import TokenTexts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Meta = dict[str, Any]

class StreamedLogprobs:
    """Per choice, its output lists so far (`OutputLists`: `add` every one of its chunks, in
    order) and how many rows were given out. A jump-forward re-tokenizes the output's tail:
    positions given out already are not given again."""

    def __init__(self) -> None:
        self._lists: dict[int, OutputLists] = {}
        self._sent: dict[int, int] = {}

    def add(self, index: int, meta: Meta) -> None:
        """Reads a chunk of choice `index` (every one, in order)."""
        self._lists.setdefault(index, OutputLists()).add(meta)

    def take(self, index: int) -> Meta | None:
        """meta_info-shaped lists of choice `index`'s tokens not given out yet, or None."""
        lists = self._lists.get(index, OutputLists())
        sent = self._sent.get(index, 0)
        pairs = lists.rows("output_token_logprobs", sent)
        if not pairs:
            return None
        self._sent[index] = sent + len(pairs)
        return {"output_token_logprobs": pairs,
                "output_top_logprobs": lists.rows("output_top_logprobs", sent)}


class TokenPieces:
    """Token id -> OpenAI's `token` (its text, decoded alone) and `bytes` (the vocabulary
    entry's raw bytes: the byte-level tokens that spell one character each decode alone to
    U+FFFD, but their bytes concatenated are the character). A special token, or a vocabulary
    whose byte scheme is unknown, gives its text's UTF-8."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.text = TokenTexts(tokenizer)
        self._tokenizer = tokenizer
        self._table: list[bytes | None] | None = None

    def raw(self, token_id: int) -> bytes:
        if self._table is None:
            try:
                self._table = token_byte_table(self._tokenizer)
            except ValueError:  # neither byte-level BPE nor SentencePiece with byte fallback
                self._table = []
        data = self._table[token_id] if 0 <= token_id < len(self._table) else None
        return self.text(token_id).encode() if data is None else data


def chat_logprobs(meta: dict[str, Any], tokens: TokenPieces) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs}]}` from SGLang-style meta_info lists
    (a token forced by jump-forward has no logprob: reported as 0.0, probability 1 under the
    constraint)."""

    def entry(logprob: float | None, token_id: int) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": 0.0 if logprob is None else logprob,
                "bytes": list(tokens.raw(token_id))}

    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (logprob, token_id) in enumerate(meta.get("output_token_logprobs") or []):
        item = entry(logprob, token_id)
        item["top_logprobs"] = [entry(lp, tid) for lp, tid in (tops[i] if i < len(tops) else [])]
        content.append(item)
    return {"content": content}


def new_chat_logprobs(streamed: StreamedLogprobs | None, index: int,
                      tokens: TokenPieces) -> dict[str, Any] | None:
    """A chat chunk's `logprobs` (`chat_logprobs`'): those of choice `index`'s tokens not
    given out yet; None when there are none or none were asked for (`streamed` None)."""
    new = streamed.take(index) if streamed is not None else None
    return None if new is None else chat_logprobs(new, tokens)
