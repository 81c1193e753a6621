"""`%%lmprogram --tokens`: the cell's program runs traced on a helper thread while a `TokenView`
shows its tokens live; the view is refreshed once more from the main thread when the program
ends, so that its final state (and its static HTML) belongs to the cell's output."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lmnb.magics.abort import abort_and_settle
from lmnb.magics.errors import LMProgramInterrupted
from lmnb.magics.execution import start
from lmnb.magics.result import ProgramResult

_POLL = 0.02


def run_with_tokens(func: Callable[..., Any], backend: Any, sampling: dict[str, Any], *,
                    background: bool) -> ProgramResult:
    """`sampling` carries `token_view=True` (Program.run's flag). In the background, the
    view is shown and the handle returned at once."""
    from IPython.display import display

    from lmnb.widgets.token_view import TokenView

    result = start(func, backend, sampling)
    try:
        view = TokenView(result.state)
        display(view)
        if background:
            return result
        while not result.done:
            time.sleep(_POLL)
        result.state.run.settle()  # forks too: the view's last state is the whole run's
    except KeyboardInterrupt:
        abort_and_settle(result.state)
        raise LMProgramInterrupted() from None
    view.refresh()  # done: its updater stops by itself, the widget keeps its last state
    return ProgramResult(result.state)
