"""What the scheduler hands to the output thread: plain data, no text work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class TokenEvent:
    """One request's progress in one scheduler step. A step's events go out as one list (one
    queue put per step).

    `new_token_ids`: ids appended this step (reported as the chunk's `output_ids`). With
    `replace_output_ids` set (jump-forward re-tokenized the output), the request's whole output is
    now those ids and `new_token_ids` are the ones appended by the jump. `finished_reason` (SGLang's
    shape: {"type": "stop" | "length" | "abort", ...}) marks the request's last event; a stop on a
    token id (`"matched": int`) that is the last new id leaves that id out of the text. `meta` is
    merged into the chunk's `meta_info` (e.g. cached_tokens, forward_passes, logprob lists).
    """

    rid: int
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    replace_output_ids: list[int] | None = None
