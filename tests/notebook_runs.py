"""One execution of each example notebook per pytest session.

Under `--nbval` (`make test`) nbval runs examples/*.ipynb cell by cell. `NotebookRecorder` hears
the kernel messages of that run and replays them through nbclient's own message handling
(`NotebookClient.process_message`: the messages of each cell until its idle status, as
`NotebookClient.execute` polls them), so tests/test_notebooks.py reads the notebook (outputs
and saved widget state) that an nbclient run would have produced, without a second execution.
Widget messages that arrive after their cell is done (a live widget's poller thread) still update
the saved widget state.
examples/conftest.py attaches the recorder and orders the readers after the notebooks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import nbclient
from nbclient.exceptions import CellExecutionComplete

RECORDED: dict[str, NotebookRecorder] = {}  # notebook file name -> its run in this session


class NotebookRecorder:
    running_cell = -1  # the index in `nb.cells` of the cell nbval is executing

    def __init__(self, reference: Any) -> None:
        self.nb = copy.deepcopy(reference)  # nbval compares against `reference`: never touched
        self.client = nbclient.NotebookClient(self.nb, store_widget_state=True,
                                             record_timing=False)
        self.code_cells = {i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"}
        self.cell_of_request: dict[str, int] = {}
        self.idle: set[int] = set()

    def sent(self, msg_id: str, cell_index: int) -> None:
        self.cell_of_request[msg_id] = cell_index
        self.nb.cells[cell_index].outputs = []
        self.client.clear_before_next_output = False  # as NotebookClient.execute_cell does

    def received(self, msg: dict[str, Any]) -> None:
        index = self.cell_of_request.get(msg["parent_header"].get("msg_id"))
        if index is None:
            return
        if index in self.idle:
            # A widget's poller thread, started by a cell that is done, keeps sending state
            # changes under that cell's request: they are the notebook's widget state (what a
            # live frontend shows and saves), and a later `refresh()` that finds the state
            # already sent sends nothing.
            if msg["msg_type"].startswith("comm"):
                self.client.handle_comm_msg(self.nb.cells[index].outputs, msg, index)
            return
        try:
            self.client.process_message(msg, self.nb.cells[index], index)
        except CellExecutionComplete:
            self.idle.add(index)

    def notebook(self) -> Any | None:
        """The executed notebook, or None unless every code cell ran to its idle status without
        an error (the reader then executes the notebook itself, and sees why it fails)."""
        errored = any(o.output_type == "error" for i in self.code_cells
                      for o in self.nb.cells[i].outputs)
        if errored or self.idle != self.code_cells:
            return None
        self.client.set_widgets_metadata()
        return self.nb


def recorded_run(path: Path) -> Any | None:
    recorder = RECORDED.get(path.name)
    return recorder.notebook() if recorder else None
