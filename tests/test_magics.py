"""The IPython extension driven through a real `InteractiveShell` on a tiny random-weight Llama:
`%lmnb` load/status/flush/close/help and its `%config` options, `%%lmprogram` cells (named
programs, capture, the namespace layering, cell-line errors, trace, background, streaming,
interrupt) and `%reload_ext` / `%unload_ext` closing the runtime."""

from __future__ import annotations

import _thread
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import lmnb
from lmnb.lang import program as program_module
from lmnb.lang.backends.base import ProgramAborted
from lmnb.magics import LMProgramError, ProgramResult
from lmnb.magics.live import LiveView
from lmnb.magics.status import StatusSummary
from tests.idle import wait_idle
from tests.lmnb_shell import lmnb_shell

LONG = 's += "Count: " + gen("long", max_tokens=400, ignore_eos=True)\n'
GUARD_S = 60.0  # bounds a failing (hung) test only; no assertion depends on speed


@pytest.fixture
def ip() -> Iterator[InteractiveShell]:
    with lmnb_shell("LMNB.temperature = 0.0") as shell:
        yield shell


@pytest.fixture
def model(tiny_models) -> Path:
    return tiny_models["llama-gqa"]


@pytest.fixture
def loaded(ip: InteractiveShell, model: Path) -> InteractiveShell:
    ip.run_line_magic("lmnb", f"load {model} --max-total-tokens 4096")
    return ip


def runtime_of(ip: InteractiveShell) -> Any:
    return ip.magics_manager.registry["LMNB"].session.runtime


def schedulers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "lmnb-scheduler" and t.is_alive()}


def cell(ip: InteractiveShell, line: str, body: str) -> Any:
    return ip.run_cell_magic("lmprogram", line, body)


def test_load_status_flush_close_help(ip: InteractiveShell, model: Path, capsys,
                                      monkeypatch) -> None:
    before = schedulers()
    ip.run_line_magic("config", "LMNB.progress = True")
    ip.run_line_magic("lmnb", f"load {model} --max-total-tokens 4096 --dtype float32")
    out, err = capsys.readouterr()
    assert "lmnb: loaded llama-gqa on cpu (float32), 4096 KV tokens" in out
    assert "lmnb: loading llama-gqa" in err  # the progress bar (a widget in notebooks)
    runtime = runtime_of(ip)
    assert runtime.max_total_tokens == 4096 and len(schedulers() - before) == 1

    status = ip.run_line_magic("lmnb", "status")
    assert isinstance(status, StatusSummary) or type(status).__name__ == "CacheDashboard"
    if hasattr(status, "close"):
        status.close()
    monkeypatch.setitem(sys.modules, "lmnb.widgets", None)  # the fallback without widgets
    summary = ip.run_line_magic("lmnb", "status")
    assert isinstance(summary, StatusSummary) and "llama-gqa" in repr(summary)
    assert "cache hit rate" in repr(summary) and "<table>" in summary._repr_html_()

    ip.run_line_magic("lmnb", "flush")
    assert "prefix cache flushed" in capsys.readouterr().out
    with pytest.raises(UsageError, match="cannot load model"):
        ip.run_line_magic("lmnb", "load /no/such/model")
    assert runtime_of(ip) is runtime and runtime._scheduler._thread.is_alive()

    for line in ("--help", "help", ""):
        ip.run_line_magic("lmnb", line)
        out = capsys.readouterr().out
        assert all(word in out for word in ("load", "status", "flush", "close"))
    ip.run_line_magic("lmnb", "load --help")
    assert "--max-total-tokens" in capsys.readouterr().out
    ip.run_line_magic("lmprogram", "--help")
    assert "--bg" in capsys.readouterr().out
    assert "--trace" in ip.find_line_magic("lmprogram").__doc__
    with pytest.raises(UsageError, match="invalid choice"):
        ip.run_line_magic("lmnb", "frobnicate")

    ip.run_line_magic("lmnb", "close")
    assert "runtime closed" in capsys.readouterr().out
    assert schedulers() <= before and not runtime._scheduler._thread.is_alive()
    ip.run_line_magic("lmnb", "status")
    assert "no runtime loaded" in capsys.readouterr().out


def test_status_counts_since_the_runtime_started(loaded: InteractiveShell) -> None:
    pytest.importorskip("anywidget")
    runtime = runtime_of(loaded)
    prompt = "Repeat after me: " + "the same words " * 8
    for _ in range(2):  # the second time the prompt is cached
        runtime.generate(prompt, {"max_new_tokens": 2})
    stats = runtime.stats()
    assert stats["cached_tokens"] > 0
    dashboard = loaded.run_line_magic("lmnb", "status")
    try:
        dashboard.refresh()
        last = dashboard.series[-1]
        assert (last["prompt_tokens"], last["cached_tokens"]) == (
            stats["prompt_tokens"], stats["cached_tokens"])
        assert last["hit_rate"] == pytest.approx(stats["cached_tokens"] / stats["prompt_tokens"])
        assert "since the runtime started" in repr(dashboard)
        runtime.generate(prompt, {"max_new_tokens": 2})  # and live from then on
        dashboard.refresh()
        assert dashboard.series[-1]["cached_tokens"] > stats["cached_tokens"]
    finally:
        dashboard.close()


def _widget_pollers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "lmnb-widget-poll" and t.is_alive()}


def test_repeating_status_leaves_one_live_dashboard(loaded: InteractiveShell) -> None:
    """Each `%lmnb status` polls the runtime (a metrics bar and a dashboard, 10 times a second);
    the views of the one before stop polling and say so, keeping what they show."""
    pytest.importorskip("anywidget")
    before = _widget_pollers()
    first = loaded.run_line_magic("lmnb", "status")
    first_pollers = _widget_pollers() - before
    assert first.polling and len(first_pollers) == 2  # the bar and the dashboard
    second = loaded.run_line_magic("lmnb", "status")
    try:
        assert not first.polling and first.status == "stopped: a later %lmnb status is live"
        assert second.polling and second.status == "live"
        for thread in first_pollers:
            thread.join(timeout=30)
        assert len(_widget_pollers() - before) == 2
        first.refresh()  # a stopped view still reads the runtime when asked
        assert first.series[-1]["prompt_tokens"] == runtime_of(loaded).stats()["prompt_tokens"]
    finally:
        second.close()
        first.close()


def test_config_options_and_lazy_load(ip: InteractiveShell, model: Path, capsys) -> None:
    ip.run_line_magic("config", f"LMNB.model = {str(model)!r}")
    ip.run_line_magic("config", "LMNB.max_total_tokens = 2048")
    ip.run_line_magic("config", "LMNB.max_new_tokens = 3")
    result = cell(ip, "", 's += "Hello" + gen("x")\n')  # no %lmnb load: loads LMNB.model
    assert runtime_of(ip).max_total_tokens == 2048
    assert result.get_meta_info("x")["completion_tokens"] == 3
    result = cell(ip, "--max-tokens 5", 's += "Hello" + gen("x")\n')
    assert result.get_meta_info("x")["completion_tokens"] == 5
    with pytest.raises(Exception, match="stream_hz"):
        ip.magics_manager.registry["LMNB"].stream_hz = 1000.0
    capsys.readouterr()
    ip.run_line_magic("config", "LMNB")
    listing = capsys.readouterr().out
    names = ("model", "dtype", "device", "max_total_tokens", "temperature", "max_new_tokens",
             "stream")
    assert all(f"LMNB.{name}" in listing for name in names)


def test_named_program_runs_from_python(loaded: InteractiveShell) -> None:
    assert cell(loaded, "qa(question, n=2)", (
        's += user(question)\n'
        's += assistant(gen("answer", max_tokens=4))\n')) is None
    qa = loaded.user_ns["qa"]
    assert isinstance(qa, lmnb.Program) and qa.arg_names == ["question", "n"]
    state = qa.run(question="What is 2+2?", temperature=0)  # the kernel's runtime by default
    assert isinstance(state["answer"], str) and "What is 2+2?" in state.text()
    states = qa.run_batch([{"question": "a"}, {"question": "b"}], temperature=0,
                          progress_bar=False)
    assert [s.messages()[-2]["content"] for s in states] == ["a", "b"]
    assert qa.run(question="a", temperature=0)["answer"] == states[0]["answer"]
    with pytest.raises(UsageError, match=r"qa\(\.\.\.\)"):
        cell(loaded, "qa", "s += 'x'\n")
    with pytest.raises(UsageError, match="--bg"):
        cell(loaded, "qa(q) --bg", "s += q\n")


def test_python_runs_get_the_kernels_local_backend(loaded: InteractiveShell) -> None:
    """The default backend after %load_ext stands for the kernel's current runtime: a named
    program run from Python, `pin()` and SGLang's backend calls get its `LocalBackend` (token
    view, pinning, awaited gens, runtime stats), not a stand-in that lacks them."""
    from lmnb.lang.backends.local import LocalBackend
    from lmnb.widgets.metrics import runtime_stats

    cell(loaded, "qa(q)", 's += "A long constant instruction prefix for every call. " + q\n'
                          's += gen("a", max_tokens=2)\n')
    qa = loaded.user_ns["qa"]
    state = qa.run(q="Hello", token_view=True)
    assert state.token_trace is not None and isinstance(state.executor.backend, LocalBackend)
    assert runtime_of(loaded) is state.executor.backend.runtime
    assert runtime_stats(state)["max_total_tokens"] == 4096
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot pin a prefix; ... cached" fallback
        qa.pin()
    assert runtime_of(loaded).stats()["pinned_tokens"] > 0
    assert qa.unpin() and runtime_of(loaded).stats()["pinned_tokens"] == 0
    assert lmnb.flush_cache() is True
    assert lmnb.get_server_info()["max_total_num_tokens"] == 4096


def test_unnamed_cell_result_and_capture(loaded: InteractiveShell) -> None:
    body = 's += "The answer is" + gen("x", max_tokens=4)\n'
    result = cell(loaded, "", body)
    assert isinstance(result, ProgramResult) and result.text().startswith("The answer is")
    assert 'title="x"' in result._repr_html_() and "x = " in repr(result)
    assert cell(loaded, "-o out", body) is None
    assert cell(loaded, "out2 << --temperature 0", body) is None
    out, out2 = loaded.user_ns["out"], loaded.user_ns["out2"]
    assert out["x"] == out2["x"] == result["x"] and out.variables() == {"x": result["x"]}
    with pytest.raises(UsageError, match="not both"):
        cell(loaded, "a << -o b", body)


def test_namespace_layering(loaded: InteractiveShell) -> None:
    ns = loaded.user_ns
    ns.update(topic="cats", select="mine", image=" [pic]")
    result = cell(loaded, "", (
        's += user("Tell me about " + topic + image)\n'
        'local_var = 1\n'
        's += assistant(gen("answer", max_tokens=3))\n'
        'names = (gen_int, gen_string, select, user_end, video)\n'
        's.set_var("dsl", [getattr(f, "__name__", f) for f in names])\n'))
    assert "Tell me about cats [pic]" in result.text()
    assert result["dsl"] == ["gen_int", "gen_string", "mine", "user_end", "video"]
    assert ns["select"] == "mine" and ns["image"] == " [pic]"
    assert not {"gen", "user", "assistant", "gen_int", "video", "local_var", "s"} & set(ns)
    ns["topic"] = "dogs"  # named programs read notebook variables when they run
    cell(loaded, "about()", 's += "About " + topic\n')
    assert ns["about"].run().text() == "About dogs"

    ns["n"] = 0  # `global n`: the notebook's n, written back and read back as in any cell
    assert cell(loaded, "", 'global n\nn = 5\ns += "n=" + str(n)\n').text() == "n=5"
    assert ns["n"] == 5
    cell(loaded, "count()", 'global n\nn += 1\ns += str(n)\n')
    assert [ns["count"].run().text() for _ in range(2)] == ["6", "7"] and ns["n"] == 7


def test_errors_point_at_the_cell_line(loaded: InteractiveShell, capsys) -> None:
    body = 's += "a"\ns += gen("x", max_tokens=undefined_name)\n'
    with pytest.raises(LMProgramError) as info:
        cell(loaded, "", body)
    assert info.value.lineno == 3 and "undefined_name" in info.value.line
    rendered = "\n".join(info.value._render_traceback_())
    assert "line 3" in rendered and 's += gen("x", max_tokens=undefined_name)' in rendered
    assert "NameError: name 'undefined_name' is not defined" in rendered

    result = loaded.run_cell(f"%%lmprogram\n{body}")
    assert isinstance(result.error_in_exec, LMProgramError)
    shown = capsys.readouterr().out
    assert "line 3" in shown and "NameError" in shown and "site-packages" not in shown

    loaded.run_cell('%%lmprogram\ns += "a"\n\ns += gen("x", max_tokens=(\n')
    assert "line 4" in (shown := capsys.readouterr().out) and "SyntaxError" in shown

    with pytest.raises(LMProgramError, match="begins inside") as info:
        cell(loaded, "", "s += user_begin()\ns += user_begin()\n")
    assert "while running the program" in "\n".join(info.value._render_traceback_())
    runtime_of(loaded).check_integrity()


def test_runtime_errors_point_at_the_gen_line(loaded: InteractiveShell, capsys) -> None:
    """An error the runtime raises while a gen runs (on the program's worker thread) points at
    the cell line of that gen: an invalid regex, a prompt longer than the context."""
    body = 's += "a"\ns += gen("ok", max_tokens=2)\ns += gen("x", max_tokens=2, regex="[")\n'
    with pytest.raises(LMProgramError, match="regex") as info:
        cell(loaded, "", body)
    assert info.value.lineno == 4 and 'regex="["' in info.value.line
    rendered = "\n".join(info.value._render_traceback_())
    assert "<lmprogram cell>, line 4" in rendered and 's += gen("x", max_tokens=2, regex="[")' \
        in rendered

    loaded.run_cell('%%lmprogram\ns += "word " * 2000\n\ns += gen("y", max_tokens=2)\n')
    shown = capsys.readouterr().out
    assert "line 4" in shown and 'gen("y", max_tokens=2)' in shown and "context" in shown

    # A gen of a named program (another cell) that the cell calls: that cell's line.
    cell(loaded, "bad()", 's += "b"\ns += select("c", ["x", "y"]) + gen("z", regex="(")\n')
    with pytest.raises(LMProgramError) as info:
        cell(loaded, "", 's += "a"\nbad(s)\n')
    assert (info.value.filename, info.value.lineno) == ("<lmprogram bad>", 3)
    assert 'gen("z", regex="(")' in "\n".join(info.value._render_traceback_())
    runtime_of(loaded).check_integrity()


class FailingStep:
    """The scheduler's `step`, failing once (as a CUDA out-of-memory in a forward pass would)
    on the first step that has work, then the real one."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.real = scheduler.step
        self.failed = threading.Event()

    def __call__(self) -> bool:
        if not self.failed.is_set() and self.scheduler.has_work:
            self.failed.set()
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.real()


def test_a_gen_the_runtime_aborted_fails_the_cell(loaded: InteractiveShell, monkeypatch,
                                                  capsys) -> None:
    """A request the runtime aborts (a failed step here; also out of KV cache, `%lmnb close`
    under a --bg cell) ends with finish reason {"type": "abort", ...}: the cell fails at the
    gen's line with the runtime's message, and the rest of the body does not run. Later cells
    fail with "the scheduler failed", shown with the error it came from and a hint to reload."""
    scheduler = runtime_of(loaded)._scheduler.scheduler
    failing = FailingStep(scheduler)
    monkeypatch.setattr(scheduler, "step", failing)
    with pytest.raises(LMProgramError, match="out of memory") as info:
        cell(loaded, "", 's += "Count:" + gen("x", max_tokens=8)\ns += " and more"\n')
    assert failing.failed.is_set() and info.value.lineno == 2
    assert runtime_of(loaded).failed and "%lmnb load" in info.value.notes[-1]

    capsys.readouterr()
    loaded.run_cell('%%lmprogram\ns += "Hi" + gen("x", max_tokens=2)\n')
    shown = capsys.readouterr().out
    assert "RuntimeError: the scheduler failed" in shown
    assert "caused by: MemoryError: CUDA out of memory" in shown and "%lmnb load" in shown


def test_a_failing_cell_body_aborts_its_forks(loaded: InteractiveShell) -> None:
    """The body forks, starts long gens in the branches, then raises: the cell fails with the
    body's error once the branches' requests are aborted and stopped (their KV freed)."""
    box: list[Any] = []
    loaded.user_ns["box"] = box
    body = ('box.append(s)\n'
            's += "Ideas:"\n'
            'f = s.fork(2)\n'
            'f += gen("idea", max_tokens=400, ignore_eos=True)\n'
            'undefined_name\n')
    with pytest.raises(LMProgramError, match="NameError"):
        cell(loaded, "", body)
    state = box[0]
    forks = [e for e in state.run.executors if e is not state.executor]
    assert len(forks) == 2 and all(fork.idle for fork in forks)  # settled before the raise
    assert all(isinstance(fork.error, ProgramAborted) for fork in forks), \
        [(fork.error, fork.meta_info.get("idea", {}).get("completion_tokens")) for fork in forks]
    wait_idle(runtime_of(loaded))


def test_results_render_as_a_chat(loaded: InteractiveShell) -> None:
    from lmnb.magics.result import _COLORS

    result = cell(loaded, "", 's += system("Be brief.")\ns += user("Hi")\n'
                              's += assistant(gen("a", max_tokens=3))\n')
    page = result._repr_html_()
    chat, raw = page.split("<details", 1)
    assert [t.split('"')[0] for t in chat.split('data-role="')[1:]] == \
        ["system", "user", "assistant"]
    assert "Be brief." in chat and "&lt;|im_start|&gt;" not in chat  # the turns' content only
    assert "template text</summary>" in raw and "&lt;|im_start|&gt;system" in raw
    assert 'title="a"' in chat and 'title="a"' in raw  # the generated span, marked in both
    colours = {part.split(";")[0] for part in page.split("background:")[1:]}
    assert colours & set(_COLORS) and not colours & {"#fecaca", "#fbcfe8", "#fed7aa", "red"}
    assert repr(result).startswith("<lmprogram result: done>\nsystem: Be brief.\nuser: Hi\n"
                                    "assistant: ")

    plain = cell(loaded, "", 's += "Once upon" + gen("b", max_tokens=2)\n')  # no roles: text
    assert "<details" not in plain._repr_html_()
    assert repr(plain).startswith("<lmprogram result: done>\nOnce upon")


def test_trace(loaded: InteractiveShell, capsys) -> None:
    loaded.user_ns["topic"] = "cats"
    generated = runtime_of(loaded).stats()["generated_tokens"]
    assert cell(loaded, "--trace", (
        's += user(topic)\n'
        'f = s.fork(2)\n'
        'f += gen("idea", max_tokens=3)\n'
        'f.join()\n'
        's += assistant(gen("answer", max_tokens=4))\n')) is None
    out = capsys.readouterr().out
    assert "text 'cats'" in out and "gen answer" in out and "fork #0" in out
    assert runtime_of(loaded).stats()["generated_tokens"] == generated  # traced, not run
    cell(loaded, "qa(question) --trace", 's += user(question)\n')
    assert "argument question" in capsys.readouterr().out and "qa" in loaded.user_ns
    with pytest.raises(LMProgramError) as info:
        cell(loaded, "--trace", 's += "x" + gen("a")\nif s["a"] == "y":\n    s += "z"\n')
    assert info.value.lineno == 3


def test_background_handle(loaded: InteractiveShell) -> None:
    gate = threading.Event()
    loaded.user_ns["gate"] = gate
    # The body waits for the gate: a --bg that blocked would return only after GUARD_S, done.
    handle = cell(loaded, "--bg", f"assert gate.wait({GUARD_S})\n" + LONG.replace("400", "100"))
    assert isinstance(handle, ProgramResult) and not handle.done
    repr(handle), handle._repr_html_()  # never blocks
    gate.set()
    assert handle.wait().done and len(handle.get_meta_info("long")["finish_reason"]) > 0
    assert "done" in repr(handle)
    cell(loaded, "h << --bg", 's += "x" + gen("a", max_tokens=2)\n')
    assert loaded.user_ns["h"].wait()["a"] is not None


@pytest.mark.parametrize("widgets", [True, False])
def test_stream(loaded: InteractiveShell, widgets: bool, monkeypatch, capsys) -> None:
    body = 's += "Ideas:"\nf = s.fork(2)\nf += gen("a", max_tokens=40, ignore_eos=True)\nf.join()\n'
    if not widgets:  # the display-handle fallback
        monkeypatch.setitem(sys.modules, "lmnb.widgets", None)
        # Deterministic: the program waits until a refresh of the running view has drawn its
        # text (the view's rate limit would otherwise race a fast tiny model to the end).
        shown = threading.Event()
        refresh = LiveView.refresh

        def refresh_until_shown(view: LiveView) -> None:
            if not shown.is_set() and "Ideas:" in repr(view.result):
                view._last = float("-inf")  # this refresh draws
                refresh(view)
                shown.set()
            else:
                refresh(view)

        monkeypatch.setattr(LiveView, "refresh", refresh_until_shown)
        loaded.user_ns["shown"] = shown
        body = body.replace("\n", f"\nassert shown.wait({GUARD_S})\n", 1)
    result = cell(loaded, "--stream", body)
    assert isinstance(result, ProgramResult) and len(result["a"]) == 2 and result.done
    if not widgets:
        assert "<lmprogram result: running>\nIdeas:" in capsys.readouterr().out


@pytest.mark.parametrize("line", ["", "--stream"])
def test_interrupt_aborts_and_frees_kv(loaded: InteractiveShell, line: str,
                                       default_sigint) -> None:
    runtime = runtime_of(loaded)
    generated = runtime.stats()["generated_tokens"]

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + GUARD_S
        while runtime.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        _thread.interrupt_main()

    thread = threading.Thread(target=interrupt_when_running)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        cell(loaded, line, LONG)
    thread.join()
    wait_idle(runtime)
    runtime.check_integrity()
    stats = runtime.stats()
    assert stats["generated_tokens"] - generated < 400 and stats["protected_tokens"] == 0
    assert cell(loaded, "", 's += "ok" + gen("x", max_tokens=2)\n')["x"] is not None


def test_reload_and_unload_close_the_runtime(loaded: InteractiveShell, model: Path) -> None:
    runtime = runtime_of(loaded)
    assert runtime._scheduler._thread in schedulers()
    loaded.run_line_magic("reload_ext", "lmnb")
    assert not runtime._scheduler._thread.is_alive()
    assert loaded.find_line_magic("lmnb") is not None and runtime_of(loaded) is None

    loaded.run_line_magic("lmnb", f"load {model} --max-total-tokens 2048")
    runtime = runtime_of(loaded)
    loaded.run_line_magic("unload_ext", "lmnb")
    assert not runtime._scheduler._thread.is_alive()
    assert loaded.find_line_magic("lmnb") is None and loaded.find_cell_magic("lmprogram") is None
    assert program_module.default_backend() is None
    assert not any(type(c).__name__ == "LMNB" for c in loaded.configurables)


def test_load_makes_the_kernel_runtime_the_default_backend(loaded):
    ip = loaded
    backend = lmnb.default_backend()
    assert backend.runtime is runtime_of(ip)
    assert backend is not None and backend.runtime.generate("Hi", {"max_new_tokens": 2})
    ip.run_line_magic("unload_ext", "lmnb")
    assert lmnb.default_backend() is None


def test_serve_the_kernels_runtime(loaded: InteractiveShell, capsys) -> None:
    import httpx

    session = loaded.magics_manager.registry["LMNB"].session
    loaded.run_line_magic("lmnb", "serve --api-key k")
    server = session.server
    assert server.url in capsys.readouterr().out
    before = runtime_of(loaded).stats()["prompt_tokens"]
    response = httpx.post(f"{server.url}/generate", headers={"Authorization": "Bearer k"},
                          json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200
    assert runtime_of(loaded).stats()["prompt_tokens"] > before  # the kernel's own runtime
    loaded.run_line_magic("lmnb", "serve stop")
    assert session.server is None and not server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
    loaded.run_line_magic("lmnb", "serve")
    server = session.server
    loaded.run_line_magic("lmnb", "close")  # the server does not outlive its runtime
    assert session.server is None and not server.running
