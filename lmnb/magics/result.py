"""What a `%%lmprogram` cell returns: the program's state, shown with its generated spans."""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass
from typing import Any

_COLORS = ("#fde68a", "#bbf7d0", "#bfdbfe", "#fbcfe8", "#ddd6fe", "#fed7aa")
_MAX_VALUE = 200


@dataclass(frozen=True)
class Snapshot:
    """A state's text, spans, variables and error, read without waiting for it to finish."""

    text: str
    spans: tuple[tuple[str, int, int], ...]
    variables: dict[str, Any]
    error: BaseException | None
    running: bool


def snapshot(state: Any, running: bool = False) -> Snapshot:
    executor = state.executor  # the non-blocking view; the public readers wait for the program
    return Snapshot(executor.text_, tuple(executor.spans), dict(executor.variables),
                    executor.error, running or not executor.idle)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE else text[:_MAX_VALUE - 1] + "…"


def render_html(snap: Snapshot) -> str:
    colors = {name: _COLORS[i % len(_COLORS)]
              for i, name in enumerate(dict.fromkeys(name for name, _, _ in snap.spans))}
    parts, cursor = [], 0
    for name, start, end in sorted(snap.spans, key=lambda span: span[1]):
        if start < cursor or end > len(snap.text):
            continue  # a span that no longer matches the text (e.g. a replaced stream)
        parts.append(html.escape(snap.text[cursor:start]))
        parts.append(f'<span style="background:{colors[name]};color:#111;border-radius:3px" '
                     f'title="{html.escape(name)}">{html.escape(snap.text[start:end])}</span>')
        cursor = end
    parts.append(html.escape(snap.text[cursor:]))
    status = "running…" if snap.running else "done"
    if snap.error is not None:
        status = f"failed: {html.escape(type(snap.error).__name__)}: {html.escape(str(snap.error))}"
    rows = "".join(
        f'<tr><td style="text-align:left"><code style="background:{colors.get(name, "none")}">'
        f'{html.escape(name)}</code></td><td style="text-align:left"><code>'
        f"{html.escape(_short(value))}</code></td></tr>"
        for name, value in snap.variables.items())
    table = f'<table style="margin:4px 0">{rows}</table>' if rows else ""
    return (f'<div class="lmnb-result"><div style="font-size:smaller;opacity:.7">lmprogram: '
            f'{status}</div><pre style="white-space:pre-wrap;margin:4px 0">{"".join(parts)}</pre>'
            f"{table}</div>")


def render_text(snap: Snapshot) -> str:
    status = "running" if snap.running else "done"
    if snap.error is not None:
        status = f"failed: {type(snap.error).__name__}: {snap.error}"
    lines = [f"<lmprogram result: {status}>", snap.text]
    lines.extend(f"{name} = {_short(value)}" for name, value in snap.variables.items())
    return "\n".join(lines)


class ProgramResult:
    """A cell's `ProgramState` (`.state`) with a rich display. Reads are forwarded to the state:
    `result["answer"]`, `result.text()`, `result.variables()`, `result.fork(...)`,
    `result += ...`. For `--bg` cells it is a handle: `done`, `wait()`, `abort()`."""

    def __init__(self, state: Any, thread: threading.Thread | None = None) -> None:
        self.state = state
        self._thread = thread

    def __getattr__(self, name: str) -> Any:
        if name == "state":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.state, name)

    def __getitem__(self, name: str) -> Any:
        return self.state[name]

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def __iadd__(self, other: Any) -> ProgramResult:
        self.state += other
        return self

    @property
    def done(self) -> bool:
        """The cell's code has returned and everything it submitted has run."""
        return not self._body_running and self.state.idle

    @property
    def _body_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> ProgramResult:
        """Waits for the program to finish; Ctrl-C aborts it and frees its KV cache."""
        from lmnb.magics.execution import abort_and_settle

        try:
            while self._body_running:
                self._thread.join(0.05)
            self.state.sync()
        except KeyboardInterrupt:
            abort_and_settle(self.state)
            raise
        return self

    def _repr_html_(self) -> str:
        return render_html(snapshot(self.state, self._body_running))

    def __repr__(self) -> str:
        return render_text(snapshot(self.state, self._body_running))
