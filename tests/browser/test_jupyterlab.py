"""The example notebooks in a real JupyterLab, driven by Playwright with Debian's chromium.

A JupyterLab server (loopback only, a random token, a free port, settings and workspaces in a temp
folder, this Python as the only `python3` kernel) serves copies of 01 and 02 with their outputs
and saved widget state removed, so that every widget on the page is live. The test runs all cells
from the Run menu, waits for the widgets to finish, checks their DOM (fork texts, the hit rate,
the radix tree) and saves screenshots under `screenshots/` (git-ignored). Chromium comes from the
system (`make test` installs it with apt-get when run as root); no `playwright install`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCREENSHOTS = ROOT / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
SERVER_START_S = 90
NOTEBOOK_RUN_S = 240
UI_S = 60

SETTINGS = {  # no toasts; no kernel dialog; every cell in the DOM (no virtual scrolling)
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none", "autoStartDefaultKernel": True},
}


def _chromium() -> str:
    for candidate in (shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no chromium: `make test` installs it with apt-get when run as root "
                "(apt-get install -y chromium)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    root: Path

    def open_url(self, notebook: str) -> str:
        # its own workspace, reset: no tabs restored from an earlier page (nor their kernels)
        return (f"{self.url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}"
                f"?reset&token={self.token}")

    def shutdown_kernels(self) -> None:
        for session in self.api("sessions"):  # type: ignore[union-attr]
            self.api(f"sessions/{session['id']}", method="DELETE")

    def api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None


def _prepare(tmp: Path) -> Path:
    """Notebook copies without outputs or widget state; settings; a kernelspec for this Python."""
    import nbformat

    root = tmp / "notebooks"
    root.mkdir()
    for name in ("01_quickstart.ipynb", "02_radix_cache.ipynb"):
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        nb.metadata.pop("widgets", None)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, root / name)
    for rel, values in SETTINGS.items():
        path = tmp / "settings" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    spec = tmp / "data" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    return root


def _stop(server: subprocess.Popen, lab: Lab | None) -> None:
    """Shuts the kernels down, then the server; kills whatever of them is left."""
    import psutil

    try:
        children = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if lab is not None and server.poll() is None:
        try:
            lab.shutdown_kernels()
        except OSError:
            pass
    if server.poll() is None:
        # SIGTERM: jupyter_server stops on it whatever started pytest. SIGINT stops it only with
        # a tty (twice) or without one when not inherited as ignored, as it is by a pytest started
        # in the background (`cmd &`): there it waited the whole timeout for the kill.
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


@pytest.fixture(scope="module")
def chromium() -> str:
    pytest.importorskip("playwright.sync_api")
    pytest.importorskip("jupyterlab")
    pytest.importorskip("psutil")
    return _chromium()


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = _prepare(tmp)
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "JUPYTER_PATH": str(tmp / "data"),  # searched first: our kernelspec
           "JUPYTER_DATA_DIR": str(tmp / "data"),
           "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "run"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False",
               f"--LabApp.user_settings_dir={tmp / 'settings'}",
               f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
               "--KernelSpecManager.ensure_native_kernel=False"]
    log = (tmp / "server.log").open("wb")
    server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    handle = Lab(f"http://127.0.0.1:{port}", token, root)
    started = None
    try:
        deadline = time.monotonic() + SERVER_START_S
        while started is None:
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"jupyter lab did not start (exit code {server.poll()}):\n"
                            f"{(tmp / 'server.log').read_text()[-3000:]}")
            try:
                handle.api("status")
                started = handle
            except OSError:
                time.sleep(0.5)
        specs = handle.api("kernelspecs")
        argv = specs["kernelspecs"]["python3"]["spec"]["argv"]  # type: ignore[index]
        assert argv[0] == sys.executable, argv  # the kernel imports this checkout's lmnb
        yield handle
    finally:
        _stop(server, started)
        log.close()


@pytest.fixture(scope="module")
def browser(chromium) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                              headless=True, timeout=UI_S * 1000)
        try:
            yield instance
        finally:
            instance.close()


ALL_EXECUTED = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return false;
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
  return prompts.length > 0 && prompts.every((p) => /\\[\\d+\\]/.test(p.textContent));
}"""


STARTED = """() => [...document.querySelectorAll(
  '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]
  .some((p) => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""


def run_notebook(browser, lab: Lab, name: str, ready: str):
    """Opens the notebook, runs all cells from the Run menu, waits for `ready` (a JS predicate)
    and for every cell to have run; returns the page."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(UI_S * 1000)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(lab.open_url(name), wait_until="domcontentloaded")
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()  # the kernel is up
    for attempt in range(3):  # a click while the session still connects can come to nothing
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            page.wait_for_function(STARTED, timeout=UI_S * 1000, polling=250)
            break
        except Exception:
            if attempt == 2:
                raise
    try:
        page.wait_for_function(ready, timeout=NOTEBOOK_RUN_S * 1000, polling=250)
        page.wait_for_function(ALL_EXECUTED, timeout=NOTEBOOK_RUN_S * 1000, polling=250)
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()
    except Exception as error:
        SCREENSHOTS.mkdir(exist_ok=True)
        page.screenshot(path=SCREENSHOTS / f"{Path(name).stem}-failed.png")
        outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
        page.close()
        raise AssertionError(f"{name} did not finish ({str(error).splitlines()[0]}); "
                             f"outputs: {outputs}; page errors: {errors}") from None
    failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert failed.count() == 0, failed.all_inner_texts()
    assert not errors, errors
    return page


def screenshot(page, locator, name: str) -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    locator.scroll_into_view_if_needed()
    page.wait_for_timeout(300)  # the scroll settles
    path = SCREENSHOTS / name
    locator.screenshot(path=path)
    page.screenshot(path=path.with_name(path.stem + "-page.png"))
    return path


FORKS_DONE = """() => {
  const view = document.querySelector('.lmnb-forkview[data-done="true"]');
  if (!view) return false;
  const marks = [...view.querySelectorAll('.lmnb-branch mark.lmnb-var[data-var="tip"]')];
  return marks.length === 3 && marks.every((m) => m.textContent.trim().length > 0);
}"""


@pytest.fixture(scope="module")
def quickstart(browser, lab: Lab) -> Iterator[object]:
    """01_quickstart run once in the page, for the tests of its widgets."""
    page = run_notebook(browser, lab, "01_quickstart.ipynb", FORKS_DONE)
    try:
        yield page
    finally:
        page.close()
        lab.shutdown_kernels()


def test_quickstart_fork_view_live(quickstart) -> None:
    page = quickstart
    view = page.locator(".lmnb-forkview")
    assert view.count() == 1 and view.get_attribute("data-done") == "true"
    branches = view.locator(".lmnb-branch")
    assert branches.count() == 3
    assert [branches.nth(i).get_attribute("data-status") for i in range(3)] == ["done"] * 3
    tips = [t.strip() for t in view.locator('mark.lmnb-var[data-var="tip"]').all_inner_texts()]
    assert len(tips) == 3 and all(tips)
    printed = page.locator(".jp-OutputArea-output").filter(has_text="sleep:").inner_text()
    assert all(tip in printed for tip in tips)  # the widget shows what s["tip"] holds
    assert "Paris" in page.locator(".lmnb-result").first.inner_text()
    screenshot(page, view, "01_quickstart-forkview.png")


TOKENS_DONE = """() => {
  const view = document.querySelector('.lmnb-tokenview[data-done="true"]');
  return view && view.querySelectorAll('.lmnb-tv-row').length === 3;
}"""


# The token spans of a view by their painted background (rgb() of the computed style): the
# fixed tints of token_view_model.COLORS, or green-dominant: generated (shaded by probability).
COLOR_COUNTS = """([view, fixed]) => {
  const counts = {computed: 0, cached: 0, generated: 0, jump_forward: 0, speculated: 0,
                  other: 0};
  for (const span of view.querySelectorAll('.lmnb-tv-row .lmnb-tv-tok')) {
    const color = getComputedStyle(span).backgroundColor;
    let origin = fixed[color];
    if (!origin) {
      const [r, g, b] = (color.match(/\\d+/g) || [0, 0, 0]).map(Number);
      origin = g > r && g > b ? "generated" : "other";
    }
    counts[origin] += 1;
  }
  return counts;
}"""


def _fixed_tints() -> dict[str, str]:
    from lmnb.widgets.token_view_model import COLORS

    def rgb(color: str) -> str:
        return "rgb({}, {}, {})".format(*(int(color[i:i + 2], 16) for i in (1, 3, 5)))

    return {rgb(color): origin for origin, color in COLORS.items() if origin != "generated"}


def test_quickstart_token_view_live(quickstart) -> None:
    """`%%lmprogram --tokens` of a program with a cached system prompt, a regex gen with
    jump-forward tokens and two forks: the token spans of each colour, counted in the page, are
    the counts of the requests' meta_info that the next cell prints."""
    page = quickstart
    page.wait_for_function(TOKENS_DONE, timeout=UI_S * 1000, polling=250)
    view = page.locator(".lmnb-tokenview")
    assert view.count() == 1
    rows = view.locator(".lmnb-tv-row")
    assert [rows.nth(i).get_attribute("data-status") for i in range(3)] == ["done"] * 3
    printed = page.locator(".jp-OutputArea-output").filter(has_text="jump-forward").last
    text = printed.inner_text()
    match = re.search(r"prompt: (\d+) cached, (\d+) computed\s+output: (\d+) generated, "
                      r"(\d+) jump-forward", text)
    assert match, text
    cached, computed, generated, jumped = map(int, match.groups())
    assert cached > 0 and jumped > 0 and generated > 0
    count = {origin: view.locator(f".lmnb-tv-row .lmnb-tv-{origin}").count()
             for origin in ("cached", "computed", "generated", "jump_forward", "speculated")}
    assert count == {"cached": cached, "computed": computed, "generated": generated,
                     "jump_forward": jumped, "speculated": 0}, (count, text)
    # and as painted: the spans of each colour
    painted = page.evaluate(COLOR_COUNTS, [view.element_handle(), _fixed_tints()])
    assert painted == {**count, "other": 0}, (painted, text)
    # generated tokens carry their logprob and alternatives for the hover
    token = rows.nth(1).locator(".lmnb-tv-generated").first
    title = token.get_attribute("title")
    assert "logprob" in title and "top alternatives:" in title, title
    token.hover()
    legend = view.locator('.lmnb-tv-key[data-origin="jump_forward"]').inner_text()
    assert legend.endswith(f" {jumped}"), legend
    metrics = view.locator(".lmnb-metrics .lmnb-metric")
    assert metrics.count() >= 6, view.inner_text()
    screenshot(page, view, "01_quickstart-tokenview.png")


DASHBOARD_DONE = """() => {
  const value = document.querySelector('.lmnb-dashboard .lmnb-hit-rate .lmnb-value');
  const optimal = document.querySelector('.lmnb-dashboard .lmnb-optimal .lmnb-value');
  const nodes = document.querySelectorAll('svg.lmnb-tree g.lmnb-node');
  return value && /^\\d/.test(value.textContent) && value.textContent !== '0.0%'
    && optimal && /^\\d/.test(optimal.textContent) && nodes.length > 7;
}"""


def test_radix_cache_dashboard_live(browser, lab: Lab) -> None:
    page = run_notebook(browser, lab, "02_radix_cache.ipynb", DASHBOARD_DONE)
    try:
        dashboard = page.locator(".lmnb-dashboard")
        hit = dashboard.locator(".lmnb-hit-rate .lmnb-value").inner_text()
        optimal = dashboard.locator(".lmnb-optimal .lmnb-value").inner_text()
        assert hit.endswith("%") and float(hit[:-1]) > 0, hit
        assert optimal.endswith("%") and float(optimal[:-1]) >= float(hit[:-1]), (hit, optimal)
        printed = page.locator(".jp-OutputArea-output").filter(
            has_text="prompt tokens (optimal").inner_text()
        assert f"hit rate {hit}" in printed  # the live widget agrees with the notebook's numbers
        nodes = page.locator("svg.lmnb-tree g.lmnb-node")
        states = {nodes.nth(i).get_attribute("data-state") for i in range(nodes.count())}
        assert nodes.count() > 7 and "root" in states, states
        screenshot(page, dashboard, "02_radix_cache-dashboard.png")
        screenshot(page, page.locator(".lmnb-radix"), "02_radix_cache-tree.png")
    finally:
        page.close()
        lab.shutdown_kernels()
