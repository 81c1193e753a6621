"""Incremental detokenization of one request's output, with stop strings.

Text is decoded from a sliding window of ids (the prefix_offset / read_offset technique of
vLLM and SGLang): `prefix` = decode(ids[prefix_offset:read_offset]) is text already emitted,
`window` = decode(ids[prefix_offset:]); the delta is window[len(prefix):]. The window starts on
the last few prompt tokens, so the first output token keeps its leading space (SentencePiece strips
the leading space of the first decoded token). The emitted text is therefore what the output adds
after the prompt: decode(tail + output)[len(decode(tail)):], where tail is the longest suffix of
the last 5 prompt ids whose decode does not start with U+FFFD (does not start inside a character).
For byte-level BPE this equals decode(output); for SentencePiece it may keep one leading space.

One exception: HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFD as soon as
the run is not valid UTF-8. Characters of the run already streamed cannot be taken back, so for
such (garbage) output the text keeps them, as SentencePiece's own decoder does.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lmnb.runtime.output.stop import StopStrings

_REPLACEMENT = "\ufffd"
PROMPT_TAIL = 5  # prompt ids the output is decoded after, at most
# Ids that may stay undecoded (an incomplete UTF-8 character never takes more than 4 bytes); past
# this many, undecodable bytes are emitted as U+FFFD so the window stays bounded.
_MAX_PENDING = 8
_TRIM_AT = 1024


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def prompt_tail(tokenizer: Decoder, prompt_ids: Sequence[int], *,
                skip_special_tokens: bool = True) -> list[int]:
    """The prompt ids the output is decoded after: the longest of the last 5 whose decode does not
    start with U+FFFD. A tail cut inside a multi-byte character would decode to U+FFFD, and HF's
    byte-fallback decoder would then spoil the whole byte run, output bytes included."""
    tail = [int(i) for i in prompt_ids[-PROMPT_TAIL:]]
    for k in range(len(tail)):
        if not tokenizer.decode(tail[k:], skip_special_tokens=skip_special_tokens).startswith(
                _REPLACEMENT):
            return tail[k:]
    return tail


# Text that HF's `clean_up_tokenization` changes (a space before . , ! ? and the contractions).
_CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j ' k"
_CLEANUP_IS_NOOP: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def fast_decode(tokenizer: Decoder, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode` as one call into the Rust tokenizer when that is what it amounts to (an
    HF fast tokenizer whose decode does not clean up spaces): the per-call Python of the wrapper
    costs more than the decoding of a few ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _cleanup_is_noop(tokenizer, backend):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


_SINGLE_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[bool, dict[int, str]]] = \
    weakref.WeakKeyDictionary()
_SINGLE_TOKEN_TEXTS_LOCK = threading.Lock()


def single_token_texts(tokenizer: Decoder, skip_special_tokens: bool) -> dict[int, str]:
    """`tokenizer.decode([id], skip_special_tokens=skip_special_tokens)` by id, as far as
    computed: one dict per tokenizer object and flag for as long as the tokenizer lives, filled
    by every thread that decodes with it (a decode is a pure function of the ids; a tokenizer
    that cannot be weakly referenced gets a new dict)."""
    with _SINGLE_TOKEN_TEXTS_LOCK:
        try:
            by_flag = _SINGLE_TOKEN_TEXTS.get(tokenizer)
            if by_flag is None:
                by_flag = _SINGLE_TOKEN_TEXTS[tokenizer] = {}
        except TypeError:
            by_flag = {}
        return by_flag.setdefault(skip_special_tokens, {})


def _cleanup_is_noop(tokenizer: Decoder, backend: Any) -> bool:
    """Whether the wrapper's decode is the backend's: no `clean_up_tokenization_spaces`, or one
    the wrapper does not apply (transformers 5 skips it for BPE models), seen on text it would
    change. Once per tokenizer."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return True
    known = _CLEANUP_IS_NOOP.get(tokenizer)
    if known is None:
        ids = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
        known = tokenizer.decode(ids, skip_special_tokens=False) == backend.decode(
            ids, skip_special_tokens=False)
        _CLEANUP_IS_NOOP[tokenizer] = known
    return known


class IncrementalDetokenizer:
    """Turns a request's generated ids into stable text deltas; one per request, one thread."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = fast_decode(tokenizer, skip_special_tokens)
        # the prefix of a window is mostly the one id read last step
        self._single_texts = single_token_texts(tokenizer, skip_special_tokens)
        self._stops = StopStrings.of(stop)
        self.stop: tuple[str, ...] = self._stops.strings
        self._ids = prompt_tail(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""
        self._chunks: list[str] = []
        self._text: str | None = ""
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far: the concatenation of every delta returned."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text

    @property
    def decoded_text(self) -> str:
        """`text` and the tail held back because it may begin a stop string: all the text the
        output has decoded to so far (what a stop regex is searched in)."""
        return self.text + self._pending

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; returns the new text that is safe to stream."""
        if self.finished or len(token_ids) == 0:
            return ""
        self._ids.extend(map(int, token_ids))
        delta = self._decode_delta(final=False)
        if not self.stop:  # nothing to match or hold back (nothing pending either)
            return self._emit(delta)
        self._pending += delta
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: flush held-back text (never a matched stop string)."""
        if self.finished:
            return ""
        self._pending += self._decode_delta(final=True)
        return self._release(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def _advance(self, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode_delta(self, *, final: bool) -> str:
        ids = self._ids
        start, read, end = self._prefix_offset, self._read_offset, len(ids)
        if read == end:
            return ""
        decode = self._decode_ids
        if read - start == 1:
            prefix = self._single_texts.get(ids[start])
            if prefix is None:
                prefix = self._single_texts[ids[start]] = decode(ids[start:read])
        else:
            prefix = decode(ids[start:read])
        window = decode(ids[start:end])
        stalled = end - read > _MAX_PENDING
        if final or not window.endswith(_REPLACEMENT):
            if len(window) > len(prefix) or final or stalled:
                self._advance(end)
                return window[len(prefix):]
            return ""
        if not stalled:
            return ""
        # Undecodable bytes keep the window open: emit up to the last clean boundary.
        cut = max(read + 1, end - 3)
        for j in range(end - 1, read, -1):
            window = self._decode(start, j)
            if not window.endswith(_REPLACEMENT):
                cut = j
                break
        else:
            window = self._decode(start, cut)
        self._advance(cut)
        return window[len(prefix):]

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        if self.stop and pending:
            hit = self._stops.first(pending)
            if hit is not None:
                self.matched_stop = hit[1]
                self.finished = True
                self._pending = ""
                return self._emit(pending[:hit[0]])
        if final:
            self.finished = True
            self._pending = ""
            return self._emit(pending)
        hold = self._stops.held(pending) if self.stop else 0
        self._pending = pending[len(pending) - hold:] if hold else ""
        return self._emit(pending[:len(pending) - hold])

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta
