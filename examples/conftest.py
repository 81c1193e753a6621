"""nbval's run of each notebook is recorded for tests/test_notebooks.py (tests/notebook_runs.py);
the readers of those runs (tests using the `example_run` fixture) are moved after the notebooks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from nbval.plugin import IPyNbCell

    from tests.notebook_runs import RECORDED, NotebookRecorder
except ImportError:  # without nbval (or nbclient) no notebook is collected here
    IPyNbCell = None


def _recorder(notebook_file: Any) -> NotebookRecorder:
    """Created at the notebook's first cell: nbval has started its kernel by then."""
    name = Path(str(notebook_file.fspath)).name
    if name not in RECORDED:
        recorder = RECORDED[name] = NotebookRecorder(notebook_file.nb)
        kernel, get_message = notebook_file.kernel, notebook_file.get_kernel_message
        execute = kernel.execute_cell_input

        def execute_and_note(*args: Any, **kwargs: Any) -> str:
            msg_id = execute(*args, **kwargs)
            recorder.sent(msg_id, recorder.running_cell)
            return msg_id

        def get_and_replay(*args: Any, **kwargs: Any) -> dict[str, Any]:
            msg = get_message(*args, **kwargs)
            recorder.received(msg)
            return msg

        kernel.execute_cell_input = execute_and_note
        notebook_file.get_kernel_message = get_and_replay
    return RECORDED[name]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    notebook_file = item.parent
    if IPyNbCell is not None and isinstance(item, IPyNbCell) and notebook_file.kernel is not None:
        recorder = _recorder(notebook_file)
        recorder.running_cell = next(i for i, c in enumerate(notebook_file.nb.cells)
                                     if c is item.cell)
    return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reads = {id(item) for item in items if "example_run" in getattr(item, "fixturenames", ())}
    items[:] = ([item for item in items if id(item) not in reads]
                + [item for item in items if id(item) in reads])


NOTEBOOK_READERS = "tests/test_notebooks.py"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist's `--dist loadfile` (`make test`), the example notebooks and the tests
    that read their recorded runs form one unit of work: the recordings live in the worker process
    that ran the notebooks. Every other test file is a unit of its own, as loadfile has it."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class NotebooksWithReaders(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope == NOTEBOOK_READERS or (scope.startswith("examples/")
                                             and scope.endswith(".ipynb")):
                return "example notebooks"
            return scope

    return NotebooksWithReaders(config, log)
