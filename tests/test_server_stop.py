"""`ServerHandle.stop()` with requests in flight (streamed or not, n > 1, with tools): their
responses are cancelled and cleaned up as on a client disconnect, so their requests are aborted
and the client's connection ends."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from lmnb.runtime.engine import Runtime
from lmnb.server import ServerHandle
from tests import idle

CHAT = [{"role": "user", "content": "Name a colour."}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=8192,
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


def wait_idle(rt: Runtime) -> dict:
    return idle.wait_idle(rt, 60.0, unlocked=True)


@pytest.mark.parametrize("stream", [True])
@pytest.mark.parametrize("tools", [None, WEATHER])
def test_stop_with_an_open_request_aborts_it(rt, stream, tools):
    """`ServerHandle.stop()` with a chat request in flight: its requests are aborted."""
    import threading

    tokens, n = 400, 4
    before = wait_idle(rt)["generated_tokens"]
    handle = ServerHandle.start(rt)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": tokens, "n": n,
            "ignore_eos": True, "stream": stream}
    if tools:
        body.update(tools=tools, tool_choice="required")

    def client() -> None:
        try:
            with httpx.Client(base_url=handle.url, timeout=20) as c:
                with c.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
        except httpx.HTTPError:
            pass

    rt.set_batch_hook(lambda batch: time.sleep(0.02))  # the requests outlast the stop anywhere
    try:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while rt.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.stats()["running"] > 0
        handle.stop()
        thread.join(10)
    finally:
        rt.set_batch_hook(None)
    client_ended = not thread.is_alive()  # the server closed the connection
    stats = wait_idle(rt)
    generated = stats["generated_tokens"] - before
    rt.check_integrity()
    assert generated < n * tokens * 0.9, generated
    assert client_ended, "the client still waits on a connection the stopped server left open"
