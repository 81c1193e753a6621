"""Where every request of the scheduler is: exactly one of `waiting` (no KV), `chunked` (part of
its prompt prefilled), `prefilling` (its prompt's last part is in a pass not processed yet),
`running` (decoding); its `ReqState` is found by id."""

from __future__ import annotations

from lmnb.runtime.core import Req, ReqStatus
from lmnb.runtime.scheduler.request_state import ReqState


class RequestTable:
    def __init__(self) -> None:
        self.states: dict[int, ReqState] = {}
        self.waiting: list[Req] = []
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.prefilling: dict[int, Req] = {}  # by id

    def __len__(self) -> int:
        return len(self.states)

    def add(self, state: ReqState) -> None:
        if state.rid in self.states:
            raise ValueError(f"request id {state.rid} is already live")
        self.states[state.rid] = state
        state.req.status = ReqStatus.WAITING
        self.waiting.append(state.req)

    def get(self, rid: int) -> ReqState | None:
        return self.states.get(rid)

    def state_of(self, req: Req) -> ReqState | None:
        """`req`'s state while it is live; None once it ended (e.g. aborted while a pass it is
        in was in flight: that pass's results for it are dropped)."""
        state = self.states.get(req.rid)
        return state if state is not None and state.req is req else None

    def live(self) -> list[Req]:
        """Requests holding KV."""
        return [*self.running, *([self.chunked] if self.chunked is not None else []),
                *self.prefilling.values()]

    def all(self) -> list[Req]:
        return [*self.waiting, *self.live()]

    def detach(self, req: Req) -> None:
        """Takes `req` out of whichever queue holds it (its state stays)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.prefilling.pop(req.rid, None)

    def remove(self, req: Req) -> None:
        self.detach(req)
        self.states.pop(req.rid, None)

    def requeue_front(self, req: Req) -> None:
        """Back to the head of the waiting queue (retracted, or jumped forward)."""
        req.status = ReqStatus.WAITING
        self.waiting.insert(0, req)
