"""Token id -> the raw bytes it adds to the output text (None for special tokens).

Two vocabulary schemes are understood:
- byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen2): a token string spells bytes with GPT-2's
  printable stand-ins (`Ġ` is a space); the inverse of `bytes_to_unicode` gives them back;
- SentencePiece with byte fallback (Llama-2, Mistral): `▁` is a space and `<0xAB>` is byte 0xAB.
A SentencePiece token keeps its leading space even at the start of a text (where `decode` strips
it): the bytes are what the token adds *in context*, which is what a regex constrains.
"""

from __future__ import annotations

import re
import threading
import weakref
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, list[bytes | None]]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 are
    shifted to U+0100 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def detect_scheme(tokenizer: PreTrainedTokenizerBase) -> str:
    """BYTE_LEVEL or SENTENCEPIECE, from the fast tokenizer's decoder, else from the vocabulary."""
    from transformers import PreTrainedTokenizerFast

    decoder = (repr(tokenizer.backend_tokenizer.decoder)
               if isinstance(tokenizer, PreTrainedTokenizerFast) else "")
    if "ByteLevel" in decoder:
        return BYTE_LEVEL
    if "ByteFallback" in decoder or "Metaspace" in decoder or "▁" in decoder:
        return SENTENCEPIECE
    vocab = tokenizer.get_vocab()
    if "<0x00>" in vocab or sum(t.startswith("▁") for t in vocab) > len(vocab) // 20:
        return SENTENCEPIECE
    if sum(t.startswith("Ġ") for t in vocab) > len(vocab) // 20:
        return BYTE_LEVEL
    raise ValueError(
        f"cannot tell how {type(tokenizer).__name__} spells bytes (neither byte-level BPE nor "
        "SentencePiece with byte fallback): constrained decoding is not supported for it")


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """BOS/EOS/pad/unk and every added token marked special: never part of constrained text."""
    ids = {int(i) for i in tokenizer.all_special_ids if i is not None}
    for ident, added in tokenizer.added_tokens_decoder.items():
        if added.special:
            ids.add(int(ident))
    return ids


def token_byte_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """`table[id]` is the bytes token `id` adds to the text, or None (special, unused or empty).

    Cached per tokenizer object (weakly); the list is shared, do not modify it.
    """
    size = len(tokenizer)
    with _lock:
        hit = _cache.get(tokenizer)
    if hit is not None and hit[0] == size:
        return hit[1]
    table = _build(tokenizer, size)
    with _lock:
        _cache[tokenizer] = (size, table)
    return table


def _build(tokenizer: PreTrainedTokenizerBase, size: int) -> list[bytes | None]:
    scheme = detect_scheme(tokenizer)
    specials = special_token_ids(tokenizer)
    added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
    vocab = tokenizer.get_vocab()
    size = max(size, max(vocab.values(), default=-1) + 1)
    pieces: list[str | None] = [None] * size
    for piece, ident in vocab.items():
        pieces[ident] = piece
    to_byte = _unicode_to_byte()
    table: list[bytes | None] = [None] * size
    for ident, piece in enumerate(pieces):
        if piece is None or ident in specials:
            continue
        if ident in added:  # added tokens are matched and decoded as literal text
            data = added[ident].content.encode("utf-8")
        elif scheme == BYTE_LEVEL:
            try:
                data = bytes(to_byte[ch] for ch in piece)
            except KeyError:
                data = piece.encode("utf-8")
        elif (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
            data = bytes([int(m.group(1), 16)])
        else:
            data = piece.replace("▁", " ").encode("utf-8")
        table[ident] = data or None
    return table
