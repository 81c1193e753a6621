"""`TokenView` over a traced program on a tiny runtime: a cached prefix, a regex gen with
jump-forward tokens and two forks, the counts of each colour against the requests' meta_info,
the static HTML, the metrics bar, `%%lmprogram --tokens`, and the refusals."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("anywidget")

import lmnb  # noqa: E402
from lmnb.lang.backends.local import (
    LocalBackend,  # noqa: E402
    start_trace,  # noqa: E402
)
from lmnb.lang.token_trace import ORIGIN_INDEX, TokenTrace, TraceLog  # noqa: E402
from lmnb.runtime.engine import Runtime  # noqa: E402
from lmnb.runtime.output.token_origins import count_origin  # noqa: E402
from lmnb.widgets.metrics import metrics_text, program_metrics, runtime_stats  # noqa: E402

PREFIX = "You are a careful assistant. Answer every question in one short sentence.\n"
WHY_TOKENS = 6  # each fork's gen (tests/gpu/test_token_view_cuda.py runs the program too)


@lmnb.function
def answer_and_explain(s):
    s += PREFIX + "Q: Is the sky blue?\nA:"
    s += lmnb.gen("answer", regex=r" The answer is (yes|no)\.", max_tokens=16)
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += lmnb.gen("why", max_tokens=WHY_TOKENS, temperature=1.0, seed=i, ignore_eos=True)
    s += "\nDone."


@pytest.fixture(scope="module")
def backend(tiny_models) -> Iterator[LocalBackend]:
    with Runtime(tiny_models["llama-gqa"], device="cpu", max_total_tokens=2048,
                 check_integrity_each_step=True) as runtime:
        yield LocalBackend(runtime)


def _metas(state: Any) -> list[dict[str, Any]]:
    """Each request's final meta_info once (forks copy their parent's)."""
    seen: dict[int, dict[str, Any]] = {}
    for executor in state.run.executors:
        for meta in executor.meta_info.values():
            seen.setdefault(id(meta), meta)
    return list(seen.values())


def test_token_view_counts_match_meta_info(backend: LocalBackend) -> None:
    backend.runtime.cache_prefix(PREFIX)
    state = answer_and_explain.run(backend=backend, token_view=True, temperature=0)
    state.run.settle()  # the forks too (a run waits for its root state only)
    view = state.token_view(title="tokens")
    view.refresh()
    assert view.done and [row["label"] for row in view.rows] == ["root", "fork 1", "fork 2"]
    answer = state.get_meta_info("answer")
    metas = _metas(state)
    assert len(metas) == 3
    # the prefix cached before the run; the forks' prompts are the root's tokens exactly
    assert view.counts["cached"] == answer["cached_tokens"] > 0
    assert view.counts["computed"] == answer["prompt_tokens"] - answer["cached_tokens"]
    jumped = sum(count_origin(m["output_token_origins"], "jump_forward") for m in metas)
    generated = sum(count_origin(m["output_token_origins"], "generated") for m in metas)
    assert view.counts["jump_forward"] == jumped > 0
    assert view.counts["generated"] == generated == sum(
        m["completion_tokens"] for m in metas) - jumped
    root, *forks = view.rows
    assert root["tail"] == "\nDone." and all(len(view.tokens(f)) == WHY_TOKENS for f in forks)
    assert "".join(t[0] for t in view.tokens(root)) + root["tail"] == state.text()
    # what a saved notebook's widget state keeps: every row's tokens
    assert json.loads(view.snapshot) == {"seq": view._model.seq, "rows": {
        str(r["id"]): view.tokens(r) for r in view.rows}}
    for fork, executor in zip(forks, state.run.executors[1:], strict=True):
        tokens = view.tokens(fork)
        assert "".join(t[0] for t in tokens) == executor.variables["why"]
        assert all(t[2] is not None and len(t[3]) == 5 for t in tokens)  # logprob, top 5
    # the saved notebook's HTML shows the same tokens, with their hover texts
    page = view._repr_mimebundle_()[0]["text/html"]
    for origin, count in view.counts.items():
        assert len(re.findall(rf'class="lmnb-tv-tok lmnb-tv-{origin}"', page)) == count
    assert 'data-metric="cache_hit"' in page and "top alternatives:" in page
    text = repr(view)
    assert text.startswith("TokenView: 3 rows, done") and "metrics: time to first token" in text
    metrics = program_metrics(state, runtime_stats(state))
    assert metrics is not None
    prompt = sum(m["prompt_tokens"] for m in metas)
    assert metrics.cache_hit_share == pytest.approx(
        sum(m["cached_tokens"] for m in metas) / prompt)
    assert metrics.jump_forward_share == pytest.approx(
        jumped / sum(m["completion_tokens"] for m in metas))
    assert metrics.forward_passes == sum(m["forward_passes"] for m in metas)
    assert metrics.kv_total_tokens == 2048 and metrics.ttft_s > 0 and metrics.tokens_per_s > 0
    view.close()


def test_traced_runs_through_arun_and_a_blocking_backend(backend: LocalBackend) -> None:
    """The trace is fed whether the gens are awaited on the program loop (`arun`, and `run`
    through `LocalBackend.agenerate`) or run on a pool thread (a subclass's blocking
    `generate`): the same tokens with the same origins."""

    threads: list[str] = []

    class Blocking(LocalBackend):
        def generate(self, prompt: str, params: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return super().generate(prompt, params, **kwargs)

    async def awaited() -> Any:
        return await answer_and_explain.arun(backend=backend, token_view=True, temperature=0)

    rows = []
    for state in (asyncio.run(awaited()),
                  answer_and_explain.run(backend=Blocking(backend.runtime), token_view=True,
                                         temperature=0)):
        state.run.settle()
        traces = [e.token_trace for e in state.run.executors]
        assert len(traces) == 3 and all(t is not None for t in traces)
        # ids and output origins (the prompt's cached share differs from run to run)
        rows.append([[(c[0], c[1]) for c in t.cells()
                     if c[1] >= ORIGIN_INDEX["generated"]] for t in traces])
        answer = state.get_meta_info("answer")
        assert count_origin(answer["output_token_origins"], "jump_forward") > 0
    assert rows[0] == rows[1] and all(rows[0])
    assert len(threads) == 3 and threading.main_thread().name not in threads


def test_untraced_runs_have_metrics_but_no_token_view(backend: LocalBackend) -> None:
    state = answer_and_explain.run(backend=backend, temperature=0)
    state.run.settle()
    with pytest.raises(ValueError, match="token_view=True"):
        state.token_view()
    metrics = program_metrics(state)
    assert metrics is not None and metrics.forward_passes > 0 and metrics.ttft_s > 0
    assert metrics.jump_forward_share is not None and metrics.kv_total_tokens is None
    assert "jump-forward" in metrics_text(metrics)
    with pytest.raises(ValueError, match="in-process runtime"):
        start_trace(object())


def test_lmprogram_tokens_cell(tiny_models) -> None:
    from tests.lmnb_shell import lmnb_shell

    with lmnb_shell() as ip:
        ip.run_line_magic("lmnb", f"load {tiny_models['llama-gqa']} --max-total-tokens 1024")
        shown: list[Any] = []
        ip.display_pub.publish = lambda data, **kwargs: shown.append(data)
        result = ip.run_cell_magic("lmprogram", "--tokens --temperature 0",
                                   's += "Count: " + gen("n", regex="[0-9]{3}", max_tokens=4)')
        views = [d for d in shown if "text/html" in d and "lmnb-tokenview-static" in
                 d["text/html"]]
        assert views, shown
        assert re.fullmatch("[0-9]{3}", result["n"])
        assert views[-1]["text/html"].count("lmnb-tv-generated") == 3
        assert "metrics: time to first token" in repr(result)
        assert 'class="lmnb-metrics"' in result._repr_html_()
        shown.clear()  # `%lmnb status` shows the runtime's metrics bar above its dashboard
        dashboard = ip.run_line_magic("lmnb", "status")
        dashboard.close()
        bars = [d["text/html"] for d in shown if 'class="lmnb-metrics"' in d.get("text/html", "")]
        assert bars and all(f'data-metric="{key}"' in bars[0] for key in (
            "ttft", "tokens_per_s", "cache_hit", "jump_forward", "forward_passes", "kv_pool"))


def test_a_retokenized_boundary_keeps_the_earlier_tokens() -> None:
    """A later prompt that re-tokenizes the end of the text before it: the earlier cells stay up
    to the last boundary both tokenizations share; the prompt's ids from there are new."""
    texts = {1: "ab", 2: "c", 3: "abc", 4: " d", 7: "ab", 8: "c d", 9: "x"}
    log = TraceLog(texts.__getitem__)
    trace = TokenTrace(log)

    def gen(prompt: list[int], output: list[int], cached: int) -> None:
        record = trace.request(prompt, prompt_chars=0)
        record.update({"output_ids": output, "meta_info": {
            "finish_reason": {"type": "length"}, "cached_tokens": cached,
            "output_token_origins": [("generated", 0, len(output))],
            "output_token_logprobs": [(-0.5, t) for t in output]}}, text_chars=0)

    gen([9], [1, 2], cached=0)  # "x" + generated "ab" "c"
    gen([9, 3, 4, 9], [], cached=3)  # the text as "abc", then " d" (cached) "x": cells stay
    assert [(c[0], c[1]) for c in trace.cells()] == [(9, 1), (1, 2), (2, 2), (4, 0), (9, 1)]
    trace = TokenTrace(log)
    gen([9], [1, 2], cached=0)
    gen([9, 7, 8], [], cached=0)  # "c" merged into "c d": "ab" stays generated
    assert [(c[0], c[1]) for c in trace.cells()] == [(9, 1), (1, 2), (8, 1)]


def test_logprobs_on_the_wire_have_three_places() -> None:
    """The view's cheap rounding agrees with `round(x, 3)` (up to ties) and passes -inf (a
    masked alternative) and nan through."""
    import math
    import random

    from lmnb.widgets.token_view_model import _places3

    rng = random.Random(0)
    for x in [-rng.random() * 20 for _ in range(2000)] + [0.0, -0.0004, -1e-9, 1e-9]:
        assert abs(_places3(x) - round(x, 3)) < 1e-9 or abs(x * 1000 % 1 - 0.5) < 1e-6
    assert _places3(-1.2345) == -1.235 and _places3(-math.inf) == -math.inf
    assert math.isnan(_places3(math.nan))


def test_snapshot_json_is_json_dumps_in_chunks() -> None:
    from lmnb.widgets.token_view_model import snapshot_json

    token = [' "q"\\\n\u00e9', 2, -1.25, [["x", -0.5], ["y", -2.0]]]
    rows = [(7, [token] * 600), (8, []), (9, [token] * 3)]  # 600: three chunks
    assert snapshot_json(3, rows) == json.dumps({"seq": 3, "rows": {
        str(row_id): tokens for row_id, tokens in rows}})
    assert snapshot_json(0, []) == json.dumps({"seq": 0, "rows": {}})


def test_metrics_bar_of_a_runtime(backend: LocalBackend) -> None:
    from lmnb.widgets.metrics_bar import MetricsBar

    runtime = backend.runtime
    runtime.generate("Count: ", {"regex": "[0-9]{2}, [0-9]{2}", "max_new_tokens": 8})
    stats = runtime.stats()
    bar = MetricsBar(runtime, interval_s=None)
    assert bar.metrics["forward_passes"] == stats["forward_passes"] > 0
    assert bar.metrics["ttft_s"] == pytest.approx(stats["mean_first_token_latency"])
    assert bar.metrics["jump_forward_share"] == pytest.approx(
        stats["jump_forward_tokens"] / (stats["generated_tokens"] + stats["jump_forward_tokens"]))
    assert bar.metrics["kv_total_tokens"] == 2048 and bar.metrics["gpu_allocated_gb"] is None
    assert 'data-metric="kv_pool"' in bar._repr_mimebundle_()[0]["text/html"]
    assert repr(bar).startswith("MetricsBar (live): metrics: time to first token")
    bar.close()


def test_metrics_bar_items_from_runtime_stats() -> None:
    """Every item of the bar from a CUDA runtime's `stats()` (GPU memory only where the device
    reports it; tests/gpu/test_token_view_cuda.py reads a real one)."""
    from lmnb.widgets.metrics import metrics_html, runtime_metrics

    stats = {"mean_first_token_latency": 0.25, "prompt_tokens": 200, "cached_tokens": 150,
             "generated_tokens": 90, "jump_forward_tokens": 10, "forward_passes": 42,
             "max_total_tokens": 4096, "free_tokens": 3072,
             "device_memory": {"allocated_gb": 1.5, "reserved_gb": 2.0, "total_gb": 79.2}}
    metrics = runtime_metrics(stats, tokens_per_s=123.4)
    page = metrics_html(metrics)
    shown = dict(re.findall(r'data-metric="(\w+)"><span[^>]*>[^<]*</span> <b>([^<]*)</b>', page))
    assert shown == {"ttft": "250 ms", "tokens_per_s": "123.4", "cache_hit": "75.0%",
                     "jump_forward": "10.0%", "forward_passes": "42",
                     "kv_pool": "1,024 / 4,096 (25%)", "gpu_memory": "1.50 / 79.2 GiB"}
    del stats["device_memory"]  # a CPU runtime: no GPU item
    assert "gpu_memory" not in metrics_html(runtime_metrics(stats))
    assert "GPU memory" in metrics_text(metrics) and "<div class" not in page[1:]


def test_headless_model_is_the_widgets_update_path(backend: LocalBackend) -> None:
    """`TokenViewModel` (no anywidget needed) publishes the fields the widget syncs and the
    token deltas, as JSON the comm can send; the ESM applies them (node) to the same tokens
    whenever it was drawn; its final state is the widget's over the same run; the trace carries
    run-length origins (one span per origin change, not one per token) and a logprob and top-5
    per generated token."""
    import subprocess
    import sys

    from lmnb.widgets.token_view_model import SYNCED, TokenViewModel

    state = answer_and_explain.run(backend=backend, token_view=True, temperature=0,
                                   stream=True)
    messages: list[dict[str, Any]] = []
    deltas: list[dict[str, Any]] = []
    snapshots: dict[int, list[dict[str, Any]]] = {}  # by the deltas sent before each
    events: list[list[Any]] = []  # what a front end gets, in order

    def publish(changes: dict[str, Any]) -> None:
        messages.append(json.loads(json.dumps(changes)))
        if "snapshot" in changes:
            events.append(["snapshot", changes["snapshot"]])
            snapshot = json.loads(changes["snapshot"])
            assert snapshot["seq"] == len(deltas)
            snapshots.setdefault(snapshot["seq"], []).append(
                {i: tokens for i, tokens in snapshot["rows"].items() if tokens})

    model = TokenViewModel(state, publish=publish,
                           send=lambda m: (deltas.append(json.loads(json.dumps(m))),
                                           events.append(["delta", deltas[-1]])),
                           start=False)
    # an update per change of the trace (not throttled): a delta per streamed chunk
    state.token_trace.log.listeners.append(model.refresh)
    model.refresh()
    state.run.settle()
    model.refresh()
    model.close()
    assert len(deltas) >= 3  # a request per gen at least
    assert model.done and messages and all(set(m) <= set(SYNCED) for m in messages)
    assert messages[-1]["done"] and "rows" in messages[0] and "snapshot" in messages[-1]
    # the deltas, applied in order as the front end does, give every row's tokens; none
    # resends a token that did not change, so together they hold about one per token shown
    front: dict[int, list[Any]] = {}
    for seq, delta in enumerate(deltas, start=1):
        assert (delta["seq"], delta["base"]) == (seq, seq - 1)
        for row_id, cut, tokens in delta["rows"]:
            assert 0 <= cut <= len(front.get(row_id, []))
            front[row_id] = front.get(row_id, [])[:cut] + tokens
        for snapshot in snapshots.get(seq, []):  # what a front end drawn late catches up from
            assert snapshot == {str(i): tokens for i, tokens in front.items() if tokens}
    shown = {r["id"]: model.tokens(r) for r in model.rows}
    assert front == shown and seq in snapshots  # the last: when done
    sent = sum(len(tokens) for d in deltas for _, _, tokens in d["rows"])
    assert sent <= 1.5 * sum(map(len, shown.values()))
    _front_end_replays(events, shown)
    resent: list[dict[str, Any]] = []
    model._send = resent.append  # a front end drawn now asks for the whole state
    model.resync()
    assert resent == [{"seq": len(deltas), "base": None,
                       "rows": [[i, 0, tokens] for i, tokens in shown.items()]}]
    view = state.token_view()
    view.refresh()
    assert model.counts == view.counts
    assert json.loads(model.snapshot)["rows"] == json.loads(view.snapshot)["rows"]
    assert [model.tokens(r) for r in model.rows] == [view.tokens(r) for r in view.rows]
    view.close()
    for meta in _metas(state):
        spans = meta["output_token_origins"]
        runs = 1 + sum(a[0] != b[0] for a, b in zip(spans, spans[1:], strict=False))
        # a run per change of origin (each jump adds at most two), never a span per token
        assert len(spans) == runs <= 2 * meta.get("jump_forward_steps", 0) + 1
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        tops = meta["output_top_logprobs"]
        assert len(tops) == meta["completion_tokens"]
        # top-5 per sampled token (re-tokenized and jumped ones were not sampled: none)
        assert all(len(row) == 5 for row in tops) if not meta.get("jump_forward_steps") \
            else all(len(row) in (0, 5) for row in tops)
    # the update path imports where no Jupyter package does (a GPU host's bench)
    code = ("import sys\n"
            "for name in ('anywidget', 'traitlets', 'ipywidgets', 'IPython'):\n"
            "    sys.modules[name] = None\n"
            "import lmnb.widgets, lmnb.widgets.token_view_model; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


_REPLAY = """
const events = JSON.parse(process.argv[2]);
const out = [];
for (let drawn = 0; drawn <= events.length; drawn++) {  // a front end drawn after `drawn`
  const tokens = store();
  let snapshot = "";
  events.forEach(([kind, payload], i) => {
    if (kind === "snapshot") snapshot = payload;
    if (i === drawn) catchUp(tokens, snapshot);
    if (i < drawn) return;
    if (kind === "delta") receive(tokens, payload); else catchUp(tokens, payload);
  });
  if (drawn === events.length) catchUp(tokens, snapshot);
  out.push(Object.fromEntries([...tokens.rows].map(([id, row]) => [id, row.toks])));
}
console.log(JSON.stringify(out));
"""


def _front_end_replays(events: list[list[Any]], shown: dict[int, list[Any]]) -> None:
    """The ESM's own `receive` / `catchUp` (node, where installed) over the messages, for a
    front end drawn before each of them: all end with the model's tokens (from the deltas in
    step, or from a snapshot after missing some)."""
    import shutil
    import subprocess
    import tempfile

    from lmnb.widgets.token_view import _ESM

    node = shutil.which("node")
    if node is None:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".mjs", delete=False) as script:
        script.write(_ESM.replace("export default { render };", _REPLAY))
    try:
        out = subprocess.run([node, script.name, json.dumps(events)], capture_output=True,
                             text=True, timeout=60)
    finally:
        import os

        os.unlink(script.name)
    assert out.returncode == 0, out.stderr
    expected = {str(i): tokens for i, tokens in shown.items()}
    replays = json.loads(out.stdout)
    assert len(replays) == len(events) + 1
    assert all({k: v for k, v in r.items() if v} == {k: v for k, v in expected.items() if v}
               for r in replays)
