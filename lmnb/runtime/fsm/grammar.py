"""lmnb's `Grammar` (see protocol.py): a request's place in its compressed FSM, the token mask to
sample from and the state to advance."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmnb.runtime.fsm.index import TokenIndex
from lmnb.runtime.kernels.metadata import to_device
from lmnb.runtime.sampling.bitmask import with_bits


class RequestGrammar:  # implements protocol.Grammar
    """Walks one request through a shared `TokenIndex`. Stop tokens (EOS) are allowed only in
    accepting states; a dead end (no token continues and the text is incomplete) allows them too,
    so that the request ends instead of the batch failing."""

    def __init__(self, index: TokenIndex, pattern: str) -> None:
        self.index = index
        self.pattern = pattern
        self.state = index.initial
        self._bitmasks: dict[tuple[int, str, frozenset[int]], torch.Tensor] = {}

    def mask(self, stop_ids: Iterable[int]) -> torch.Tensor:
        """Bool [vocab] of the tokens allowed next."""
        allowed = self.index.allowed(self.state)
        if self._stops_allowed():
            allowed = allowed.clone()
            for token in stop_ids:
                if 0 <= token < allowed.numel():
                    allowed[token] = True
        return allowed

    def bitmask(self, stop_ids: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Packed int32 [ceil(vocab / 32)] form of `mask(stop_ids)` on `device`, cached per
        (state, device, stop ids); callers must not modify it."""
        stops = frozenset(stop_ids)
        key = (self.state, str(device), stops)
        if (packed := self._bitmasks.get(key)) is None:
            if self._stops_allowed():
                packed = to_device(with_bits(self.index.bitmask(self.state), stops), device)
            else:
                packed = self.index.bitmask(self.state, device)
            self._bitmasks[key] = packed
        return packed

    def _stops_allowed(self) -> bool:
        """Stop ids are allowed in accepting states and at dead ends."""
        return self.index.is_accepting(self.state) or not self.index.can_continue(self.state)

    def fork(self) -> RequestGrammar:
        """A copy at the same state, sharing the index and the bitmask cache."""
        twin = RequestGrammar.__new__(RequestGrammar)
        twin.index, twin.pattern, twin.state = self.index, self.pattern, self.state
        twin._bitmasks = self._bitmasks
        return twin

    def advance(self, token_id: int) -> None:
        self.state = self.index.next_state(self.state, token_id)

    def advance_text(self, text: str) -> None:
        self.state = self.index.fsm.walk(self.state, text.encode("utf-8"))

    @property
    def is_final(self) -> bool:
        return self.index.is_final(self.state)

    @property
    def is_dead(self) -> bool:
        return self.state < 0

    def forced_text(self) -> str:
        """Text every continuation starts with (whole characters), '' if the model has a choice."""
        return self.index.forced_bytes(self.state).decode("utf-8") if self.state >= 0 else ""
