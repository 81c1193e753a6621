"""Compressed FSM and jump-forward decoding (SGLang paper, Appendix B).

A run of singular transitions (states with exactly one way to continue) is text the model has no
choice about; the compressed FSM reads it off at once (`forced_bytes`), and jump-forward appends it
to the output in one prefill instead of one decode step per token. The text is re-tokenized as a
whole, because the tokens the model would have produced differ from tokenizing the pieces
separately (`{"na` + `me": "` vs `{"` + `name` + `": "`); the jump is refused when that would
change a prompt token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmnb.runtime.fsm.regex import ByteFSM
from lmnb.runtime.fsm.token_bytes import token_byte_table

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class CompressedFSM:
    """Memoized forced strings of a ByteFSM's states."""

    def __init__(self, fsm: ByteFSM) -> None:
        self.fsm = fsm
        self._forced: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def forced_bytes(self, state: int) -> bytes:
        """The longest byte string every match continues with from `state`, cut back to a whole
        character: follow states that are not accepting (an accepting state may end the output)
        and have exactly one outgoing byte. Empty when `state` is inside a multi-byte character
        (the forced text would not be whole characters) or when the model has a choice."""
        if (hit := self._forced.get(state)) is not None:
            return hit
        fsm = self.fsm
        out = bytearray()
        cut = 0
        seen = set()
        current = state
        if fsm.is_boundary(state):
            while current not in fsm.accepting and len(fsm.transitions[current]) == 1:
                if current in seen:  # unreachable in a trim FSM (a forced cycle never accepts)
                    break
                seen.add(current)
                (byte, current), = fsm.transitions[current].items()
                out.append(byte)
                if fsm.is_boundary(current):
                    cut = len(out)
        forced = bytes(out[:cut])
        with self._lock:
            self._forced[state] = forced
        return forced


@dataclass(frozen=True, slots=True)
class JumpPlan:
    """Replace the request's output ids from position `keep` on with `new_output_ids[keep:]`
    (drop the KV of the old tail, prefill the new one); `new_output_ids` is the whole output."""

    new_output_ids: list[int]
    keep: int
    # The first of the new ids made only of forced text (those before it spell old output
    # text, re-tokenized); None: not known, every appended id counts as forced.
    forced_from: int | None = None

    @property
    def appended(self) -> list[int]:
        return self.new_output_ids[self.keep:]


class JumpForward:
    """Plans jump-forward steps for one tokenizer by re-tokenizing prompt + output + forced text.

    A plan is made only when (1) the new ids start with the exact prompt ids (BOS and special
    tokens included: they must survive decode -> encode) and (2) the new output tokens spell exactly
    the old output bytes followed by the forced bytes, so the FSM state after the jump is the state
    the forced bytes lead to. Otherwise `plan` returns None and decoding goes on token by token.

    `context_tokens=None` re-tokenizes the whole prompt (about 10 ms for a 2k-token prompt on a
    CPU core); a number re-tokenizes only that many last prompt tokens with the output, under the
    same two checks (a window that does not round-trip, e.g. one starting inside a character, just
    gives no jump).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *,
                 context_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.table = token_byte_table(tokenizer)
        self.context_tokens = context_tokens

    def output_bytes(self, ids: Sequence[int]) -> bytes | None:
        """The bytes `ids` add to the text, or None if one of them is special."""
        parts = [self.table[i] if 0 <= i < len(self.table) else None for i in ids]
        return None if any(p is None for p in parts) else b"".join(parts)  # type: ignore[arg-type]

    def plan(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
             forced_text: str) -> JumpPlan | None:
        if not forced_text:
            return None
        if self.context_tokens is not None:
            prompt_ids = prompt_ids[max(len(prompt_ids) - self.context_tokens, 0):]
        prompt, output = [int(i) for i in prompt_ids], [int(i) for i in output_ids]
        old = self.output_bytes(output)
        if old is None:
            return None
        text = self.tokenizer.decode(prompt + output, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        new_ids = list(self.tokenizer.encode(text + forced_text, add_special_tokens=False))
        if new_ids[:len(prompt)] != prompt:
            return None  # the prompt/output boundary (or a special token) would change
        new_output = new_ids[len(prompt):]
        if self.output_bytes(new_output) != old + forced_text.encode("utf-8"):
            return None
        keep = 0
        for a, b in zip(output, new_output, strict=False):
            if a != b:
                break
            keep += 1
        return JumpPlan(new_output_ids=new_output, keep=keep,
                        forced_from=self._forced_from(new_output, keep, len(old)))

    def _forced_from(self, new_output: list[int], keep: int, old_bytes: int) -> int:
        """The index of the first new output id at or after `keep` that starts at or past
        byte `old_bytes` (where the forced text begins)."""
        at = 0
        for i, token in enumerate(new_output):
            if i >= keep and at >= old_bytes:
                return i
            at += len(self.table[token])
        return len(new_output)
