"""SGLang's `/start_profile` and `/stop_profile` on a tiny model on CPU: a torch profiler over the
scheduler's forward passes, written as a gzipped Chrome trace."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmnb.runtime.engine import Runtime
from lmnb.server import ServerHandle

GREEDY = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=2048)
    yield runtime
    runtime.close()


@pytest.fixture()
def http(rt) -> Iterator[httpx.Client]:
    with ServerHandle.start(rt) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_start_generate_stop_writes_a_chrome_trace(http, tmp_path):
    started = http.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert started.status_code == 200, started.text
    assert str(tmp_path) in started.text
    assert http.post("/generate", json={"text": "Hello", "sampling_params": GREEDY}
                     ).status_code == 200
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    [trace] = tmp_path.glob("*-TP-0.trace.json.gz")
    assert str(trace) in stopped.text
    names = {event.get("name") for event in trace_events(trace)}
    assert "aten::mm" in names or "aten::addmm" in names  # the passes' matmuls were traced


def test_stop_without_start_and_start_twice_are_400s(http):
    stop = http.post("/stop_profile")
    assert stop.status_code == 400
    assert "not in progress" in stop.json()["error"]["message"]
    assert http.get("/start_profile").status_code == 200  # default: a temporary directory
    again = http.post("/start_profile", json={})
    assert again.status_code == 400 and "already in progress" in again.json()["error"]["message"]
    assert http.post("/stop_profile").status_code == 200


def test_bad_options_are_400s_naming_them(http):
    for body, param in (({"activities": ["MEM"]}, "activities"),
                        ({"activities": ["GPU"]}, "activities"),  # a CPU runtime
                        ({"num_steps": 0}, "num_steps"),
                        ({"start_step": 3}, "start_step")):
        answer = http.post("/start_profile", json=body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"] == param
    assert http.post("/stop_profile").status_code == 400  # none of them started one


def test_num_steps_stops_by_itself(rt, tmp_path):
    rt.start_profile(str(tmp_path), num_steps=2)
    before = rt.stats()["forward_passes"]
    rt.generate("Hello", {**GREEDY, "max_new_tokens": 6})  # a prefill and five decode passes
    assert rt.stats()["forward_passes"] - before >= 3
    [trace] = tmp_path.glob("*.trace.json.gz")
    assert trace_events(trace)
    with pytest.raises(ValueError, match="not in progress"):
        rt.stop_profile()


def test_close_ends_a_running_profile_and_writes_its_trace(tiny_models, tmp_path):
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=512)
    runtime.start_profile(str(tmp_path))
    runtime.generate("Hello", GREEDY)
    runtime.close()
    [trace] = tmp_path.glob("*.trace.json.gz")
    assert trace_events(trace)
