"""What a `%%lmprogram` cell returns: the program's state, shown with its generated spans."""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass
from typing import Any

from lmnb.magics.abort import abort_and_settle

# Generated text is marked in calm tints (blues, greens, violets): nothing that reads as an error.
_COLORS = ("#bfdbfe", "#bbf7d0", "#ddd6fe", "#a5f3fc", "#c7d2fe", "#d9f99d")
_MAX_VALUE = 200
_ROLE_STYLE = "font-size:11px;font-weight:600;text-transform:uppercase;opacity:.65"
_TURN_STYLE = ("margin:4px 0;padding:4px 8px;border-radius:6px;"
               "border:1px solid var(--jp-border-color2, #e0e0e0)")
_TURN_TINT = {"user": "background:var(--jp-layout-color2, #f5f5f5)"}


@dataclass(frozen=True)
class Snapshot:
    """A state's text, spans, variables and error, read without waiting for it to finish;
    `turns` are its roles as (role, start, end) in `text`, the open one last."""

    text: str
    spans: tuple[tuple[str, int, int], ...]
    variables: dict[str, Any]
    error: BaseException | None
    running: bool
    turns: tuple[tuple[str, int, int], ...] = ()


def snapshot(state: Any, running: bool = False) -> Snapshot:
    executor = state.executor  # the non-blocking view; the public readers wait for the program
    text = executor.text_
    turns = list(executor.turns)
    if (open_role := executor.open_role) is not None:
        turns.append((open_role[0], open_role[1], len(text)))
    return Snapshot(text, tuple(executor.spans), dict(executor.variables), executor.error,
                    running or not executor.idle, tuple(turns))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE else text[:_MAX_VALUE - 1] + "…"


def _marked(snap: Snapshot, colors: dict[str, str], start: int, end: int) -> str:
    """`text[start:end]` as HTML, generated spans marked with their variable's colour."""
    parts, cursor = [], start
    for name, begin, stop in sorted(snap.spans, key=lambda span: span[1]):
        begin, stop = max(begin, cursor), min(stop, end, len(snap.text))
        if stop <= begin:
            continue  # outside this range, or no longer matching the text
        parts.append(html.escape(snap.text[cursor:begin]))
        parts.append(f'<span style="background:{colors[name]};color:#111;border-radius:3px" '
                     f'title="{html.escape(name)}">{html.escape(snap.text[begin:stop])}</span>')
        cursor = stop
    parts.append(html.escape(snap.text[cursor:end]))
    return "".join(parts)


def _status(snap: Snapshot) -> str:
    if snap.error is not None:
        return f"failed: {type(snap.error).__name__}: {snap.error}"
    return "running" if snap.running else "done"


def render_html(snap: Snapshot) -> str:
    """A chat (one labelled box per role) when the program has roles, with the raw template
    text in a collapsed `<details>`; otherwise the text. Generated spans are marked."""
    colors = {name: _COLORS[i % len(_COLORS)]
              for i, name in enumerate(dict.fromkeys(name for name, _, _ in snap.spans))}
    status = "running…" if _status(snap) == "running" else html.escape(_status(snap))
    raw = (f'<pre style="white-space:pre-wrap;margin:4px 0">'
           f"{_marked(snap, colors, 0, len(snap.text))}</pre>")
    if snap.turns:
        turns = "".join(
            f'<div class="lmnb-turn" data-role="{html.escape(role)}" '
            f'style="{_TURN_STYLE};{_TURN_TINT.get(role, "")}">'
            f'<div style="{_ROLE_STYLE}">{html.escape(role)}</div>'
            f'<div style="white-space:pre-wrap">{_marked(snap, colors, start, end)}</div></div>'
            for role, start, end in snap.turns)
        body = (f'<div class="lmnb-chat">{turns}</div><details class="lmnb-raw">'
                f'<summary style="font-size:smaller;opacity:.7;cursor:pointer">template text'
                f"</summary>{raw}</details>")
    else:
        body = raw
    rows = "".join(
        f'<tr><td style="text-align:left"><code style="background:{colors.get(name, "none")}">'
        f'{html.escape(name)}</code></td><td style="text-align:left"><code>'
        f"{html.escape(_short(value))}</code></td></tr>"
        for name, value in snap.variables.items())
    table = f'<table style="margin:4px 0">{rows}</table>' if rows else ""
    return (f'<div class="lmnb-result"><div style="font-size:smaller;opacity:.7">lmprogram: '
            f"{status}</div>{body}{table}</div>")


def render_text(snap: Snapshot) -> str:
    """The plain-text view: the chat as `role: content` lines (continuation lines indented)
    when the program has roles, else the text; then the variables."""
    lines = [f"<lmprogram result: {_status(snap)}>"]
    if snap.turns:
        for role, start, end in snap.turns:
            content = snap.text[start:end].replace("\n", "\n" + " " * (len(role) + 2))
            lines.append(f"{role}: {content}")
        lines.append("")
    else:
        lines.append(snap.text)
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
        try:
            while self._body_running:
                self._thread.join(0.05)
            self.state.sync()
        except KeyboardInterrupt:
            abort_and_settle(self.state)
            raise
        return self

    def _metrics(self, snap: Snapshot) -> Any | None:
        """The run's metrics once it is over (None while it runs, or without lmnb.widgets)."""
        if snap.running:
            return None
        try:
            from lmnb.widgets.metrics import program_metrics, runtime_stats
        except ImportError:
            return None
        return program_metrics(self.state, runtime_stats(self.state))

    def _repr_html_(self) -> str:
        snap = snapshot(self.state, self._body_running)
        page = render_html(snap)
        if (metrics := self._metrics(snap)) is not None:
            from lmnb.widgets.metrics import metrics_html

            page = page.replace('<div class="lmnb-result">',
                                f'<div class="lmnb-result">{metrics_html(metrics)}', 1)
        return page

    def __repr__(self) -> str:
        snap = snapshot(self.state, self._body_running)
        text = render_text(snap)
        if (metrics := self._metrics(snap)) is not None:
            from lmnb.widgets.metrics import metrics_text

            text += "\n" + metrics_text(metrics)
        return text
