"""The example notebooks run with nbclient, as a headless frontend that saves widget state: the
final states of ForkView, CacheDashboard and RadixTreeView are read from
`nb.metadata.widgets`. (nbval compares the notebooks' other outputs; see the Makefile.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("anywidget")

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("[0-9]*.ipynb"))
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def execute(name: str) -> Any:
    """The notebook run top to bottom in a fresh kernel of this Python (not written back)."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     store_widget_state=True,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    return nb


def widgets(nb: Any, anywidget_id: str) -> list[dict[str, Any]]:
    """The saved states of the notebook's anywidgets of class `anywidget_id`."""
    saved = nb.metadata["widgets"][WIDGET_STATE]["state"]
    return [model["state"] for model in saved.values()
            if model["state"].get("_anywidget_id") == anywidget_id]


def stdout_of(nb: Any, first_line: str) -> str:
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(first_line)]
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_hygiene(path: Path) -> None:
    """Magic cells start with their `%%` line (a comment above it would make it Python); cells that
    display widgets are left out of nbval's comparison; outputs are committed."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "commit executed outputs"
    for cell in code:
        if "%%lmprogram" in cell.source:
            assert cell.source.startswith("%%lmprogram"), cell.source
        shows_widget = any(WIDGET_VIEW in o.get("data", {}) for o in cell.outputs)
        if shows_widget:
            assert "nbval-ignore-output" in cell.metadata.get("tags", []), cell.source


def test_quickstart_fork_view_final_state() -> None:
    nb = execute("01_quickstart.ipynb")
    (view,) = widgets(nb, "lmnb.widgets.fork_view.ForkView")
    assert view["done"] is True
    assert view["root"]["status"] == "done"
    branches = view["branches"]
    assert [b["label"] for b in branches] == ["branch 1", "branch 2", "branch 3"]
    printed = stdout_of(nb, "for topic, tip in")
    for branch in branches:
        assert branch["status"] == "done" and branch["error"] is None
        tips = [s["text"] for s in branch["segments"] if s["var"] == "tip"]
        assert len(tips) == 1 and tips[0].strip(), branch
        assert tips[0] in printed  # the widget shows what the program stored in s["tip"]


def test_radix_cache_dashboard_and_tree_final_state() -> None:
    nb = execute("02_radix_cache.ipynb")
    (dashboard,) = widgets(nb, "lmnb.widgets.cache_dashboard.CacheDashboard")
    last = dashboard["series"][-1]
    assert last["prompt_tokens"] > 0 and last["cached_tokens"] > 0
    assert 0 < last["hit_rate"] <= 1
    assert dashboard["optimal"] is not None and 0 < dashboard["optimal"] <= 1
    assert last["hit_rate"] <= dashboard["optimal"] + 1e-9  # no order beats the optimal one
    assert "optimal over 7 prompts" in dashboard["optimal_note"]
    assert dashboard["stats"]["cached_tokens"] >= last["cached_tokens"]
    (tree,) = widgets(nb, "lmnb.widgets.radix_tree_view.RadixTreeView")
    nodes = tree["nodes"]
    assert tree["summary"]["nodes"] == len(nodes) > 7  # root, the shared prefix, 6 reviews
    assert sum(n["parent"] is None for n in nodes) == 1
    assert len(tree["edges"]) == len(nodes) - 1
    assert any(n["hit_count"] > 0 and n["tokens"] > 50 for n in nodes)  # the few-shot prefix
