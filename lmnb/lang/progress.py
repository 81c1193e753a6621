"""tqdm progress bars that leave their final state in a saved notebook.

In a kernel, tqdm.auto draws a widget whose plain-text fallback (what nbconvert and GitHub show)
is captured once, when the bar appears ("0/4"). Here the bar is displayed under a display id and
re-displayed when it closes: the saved text is the final one ("4/4"), or nothing for a bar that
does not stay (`leave=False`). Outside a kernel this is plain tqdm."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _Nothing:
    def _repr_html_(self) -> str:
        return ""

    def __repr__(self) -> str:
        return ""


def _notebook_tqdm(cls: type) -> bool:
    try:
        from tqdm.notebook import tqdm_notebook
    except ImportError:
        return False
    return issubclass(cls, tqdm_notebook)


@contextmanager
def progress_bar(*, total: int, desc: str, leave: bool = True, disable: bool = False,
                 **kwargs: Any) -> Iterator[Any]:
    """A `tqdm.auto` bar, closed on exit."""
    from tqdm.auto import tqdm

    if disable or not _notebook_tqdm(tqdm):
        with tqdm(total=total, desc=desc, leave=leave, disable=disable, **kwargs) as bar:
            yield bar
        return
    from IPython.display import display

    bar = tqdm(total=total, desc=desc, leave=leave, display=False, **kwargs)
    handle = display(bar.container, display_id=True)
    try:
        yield bar
    finally:
        bar.close()
        if handle is not None:
            handle.update(bar.container if leave else _Nothing())
