"""Stopping a cell's program: its requests aborted and its KV cache released."""

from __future__ import annotations

from lmnb.lang.program import ProgramState


def abort_and_settle(state: ProgramState) -> None:
    """Aborts every request of the state's run (forks included) and waits until its executors
    have stopped, so that their KV cache is released."""
    state.abort()
    state.run.settle()
