"""The disk tier across a real Jupyter kernel restart: a cell runs a long few-shot program, the
kernel restarts (a new process), the cell runs again and finds its prompt's KV pages on disk.
This is the cross-process test of the disk tier."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
PAGE = 64


def _few_shot_text(model: Path) -> tuple[str, int]:
    """A few-shot prompt of 300-480 tokens whose last partial 64-token page is short (the disk
    tier stores whole pages), and its length in tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for shots in range(40, 15, -1):
        text = "".join(f"Q: What is {i} times 3?\nA: {3 * i}\n" for i in range(shots))
        text += "Q: What is 7 times 3?\nA:"
        length = len(tokenizer(text)["input_ids"])
        if length <= 480 and (length - 1) // PAGE * PAGE >= 0.93 * length:
            return text, length
    raise AssertionError("no prompt length fits")


def _run(client: Any, code: str) -> str:
    """Executes `code`; returns its stdout; fails on an error."""
    reply_id = client.execute(code)
    out: list[str] = []
    while True:
        msg = client.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != reply_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def test_kernel_restart_keeps_a_few_shot_prefix_warm(tiny_models, tmp_path: Path) -> None:
    from jupyter_client.manager import KernelManager

    model = tiny_models["llama-gqa"]
    text, length = _few_shot_text(model)
    load = (f"%lmnb load {model} --device cpu --dtype float32 --max-total-tokens 1024 "
            f"--hicache-storage-dir {tmp_path / 'kv'}")
    cell = (f"%%lmprogram -o out\ns += {text!r}\n"
            f"s += gen('answer', max_tokens=4, temperature=0)")
    report = ("import json\nview = get_ipython().run_line_magic('lmnb', 'status')\n"
              "print(json.dumps({k: view.stats.get(k) for k in ('prompt_tokens', "
              "'cached_tokens', 'hicache_disk_loaded_tokens')}))\n"
              "print(json.dumps(out['answer']))")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               LMNB_NO_PROGRESS="1")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env, cwd=str(tmp_path))
    try:
        runs = []
        for restart in (False, True):
            if restart:
                manager.restart_kernel(now=False)  # a clean shutdown, then a new process
            client = manager.client()
            client.start_channels()
            try:
                client.wait_for_ready(timeout=120)
                _run(client, "%load_ext lmnb")
                _run(client, load)
                _run(client, cell)
                lines = _run(client, report).strip().splitlines()
                runs.append((json.loads(lines[-2]), json.loads(lines[-1])))
            finally:
                client.stop_channels()
    finally:
        manager.shutdown_kernel(now=True)
    (before, answer_before), (after, answer_after) = runs
    assert before["prompt_tokens"] == after["prompt_tokens"] == length
    assert before["cached_tokens"] == 0
    assert after["cached_tokens"] >= 0.9 * after["prompt_tokens"]
    assert after["hicache_disk_loaded_tokens"] == after["cached_tokens"]
    assert answer_after == answer_before
