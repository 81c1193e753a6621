"""The example notebooks run with nbclient, as a headless frontend that saves widget state: the
final states of ForkView, CacheDashboard and RadixTreeView are read from
`nb.metadata.widgets`. (nbval compares the notebooks' other outputs; see the Makefile.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("anywidget")

from tests.notebook_runs import recorded_run  # noqa: E402

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


@pytest.fixture
def example_run() -> Callable[[str], Any]:
    """The example notebook as `execute` gives it; under --nbval, from nbval's run of it in this
    session (tests/notebook_runs.py; these tests are ordered after the notebooks)."""
    return lambda name: recorded_run(EXAMPLES / name) or execute(name)


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


def test_quickstart_token_view_final_state(example_run) -> None:
    """The TokenView's saved state and its static HTML (what nbconvert and GitHub show) count
    the tokens that the next cell prints from the requests' meta_info."""
    import re

    nb = example_run("01_quickstart.ipynb")
    (view,) = widgets(nb, "lmnb.widgets.token_view.TokenView")
    assert view["done"] is True and [r["label"] for r in view["rows"]] == ["root", "fork 1",
                                                                         "fork 2"]
    printed = stdout_of(nb, "from lmnb.runtime.output.token_origins import count_origin")
    match = re.search(r"prompt: (\d+) cached, (\d+) computed\noutput: (\d+) generated, "
                      r"(\d+) jump-forward", printed)
    assert match, printed
    expected = dict(zip(("cached", "computed", "generated", "jump_forward"),
                        map(int, match.groups()), strict=True))
    assert {k: view["counts"][k] for k in expected} == expected
    (cell,) = [c for c in nb.cells if c.source.startswith("%%lmprogram coach")]
    page = [o["data"]["text/html"] for o in cell.outputs if "text/html" in o.get("data", {})][-1]
    for origin, count in expected.items():
        assert page.count(f'class="lmnb-tv-tok lmnb-tv-{origin}"') == count


def test_quickstart_fork_view_final_state(example_run) -> None:
    nb = example_run("01_quickstart.ipynb")
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


def test_radix_cache_dashboard_and_tree_final_state(example_run) -> None:
    nb = example_run("02_radix_cache.ipynb")
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


def test_saved_plain_text_is_the_final_state(tiny_models, tmp_path: Path) -> None:
    """What nbconvert and GitHub show of a saved notebook (each output's text/plain) is the
    widgets' final state: no "0/2" load bar, no "0/4" batch bar, no "running" fork view."""
    model = tiny_models["llama-gqa"]
    cells = [
        "%load_ext lmnb\n%config LMNB.temperature = 0",
        f"%lmnb load {str(model)!r} --max-total-tokens 2048",
        "%%lmprogram tips << --stream\n"
        's += "Tips:"\nf = s.fork(2)\nf += gen("tip", max_tokens=6)\nf.join()',
        "%%lmprogram ask(q)\ns += q + gen(\"a\", max_tokens=3)",
        'states = ask.run_batch([{"q": f"Q{i}:"} for i in range(4)], progress_bar=True)',
        "from lmnb.widgets import CacheDashboard\n"
        'rt = get_ipython().magics_manager.registry["LMNB"].session.runtime\n'
        "dash = CacheDashboard(rt, interval_s=None)\ndash",
        'ask.run_batch([{"q": "Q0:"}, {"q": "Q1:"}], progress_bar=False)\ndash.refresh()',
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     store_widget_state=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    texts = [["".join(o.get("data", {}).get("text/plain", "")) for o in cell.outputs]
             for cell in nb.cells]
    load, stream, batch = texts[1], texts[2], texts[4]
    assert not any("/2" in t for t in load), load  # the load bar left nothing behind
    assert any("lmnb: loaded" in o.get("text", "") for o in nb.cells[1].outputs)
    (view,) = [t for t in stream if t.startswith("ForkView")]
    assert view.startswith("ForkView: 2 branches, done") and "running" not in view, view
    (bar,) = [t for t in batch if "it/s" in t or "/4" in t]
    assert "4/4" in bar and "100%" in bar, bar
    (dashboard,) = texts[5]  # displayed empty, refreshed two cells later
    assert dashboard.startswith("CacheDashboard") and "cached 0 of 0" not in dashboard, dashboard


def test_llava_media_view_final_state(example_run) -> None:
    nb = example_run("04_llava.ipynb")
    (view,) = widgets(nb, "lmnb.widgets.media_reuse_view.MediaReuseView")
    items = view["items"]
    assert sorted(i["kind"] for i in items) == ["image", "image", "image", "video"]
    assert all(i["resident"] and i["thumbnail"].startswith("data:image/png;base64,")
               for i in items)
    by_tokens = {i["num_tokens"]: i for i in items}
    assert (by_tokens[2928]["hits"], by_tokens[2928]["requests"]) == (7, 8)  # the astronaut
    assert view["summary"]["media_hit_rate"] > 0.8
    printed = stdout_of(nb, "view.refresh()")
    assert printed.startswith("MediaReuseView (live): 4 media, 4 resident, 0 evicted")
