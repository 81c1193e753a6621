"""Tensor parallelism on the CPU (gloo): `Runtime(tp_size=2)` gives TP=1's greedy tokens (fp32)
on tiny models whose KV heads outnumber, equal or are fewer than the ranks; shards are slices of
the one model; workers stop on close, die with their parent, and a dead or failing worker is a
clear error."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmnb.runtime.distributed.group import TPError
from lmnb.runtime.distributed.tp_worker import FAULT_ENV
from lmnb.runtime.engine import Runtime
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers.linear import head_split
from tests.conftest import TINY_VARIANTS, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
PREFIX = ("You are a careful assistant. Read the question, think about what it asks, and "
          "answer in one short sentence. ")
QUESTIONS = ["What is a cat?", "Why is the sky blue?", "Name three colors.", "Count to five."]
OPTIONS = dict(max_total_tokens=2048, chunked_prefill_size=32, check_integrity_each_step=True)
# One KV head (replicated over the ranks), q/k/v biases, a vocabulary two ranks split unevenly.
MQA = ("qwen2", {"num_key_value_heads": 1, "vocab_size": 49155})


@pytest.fixture(scope="module")
def models(tiny_models, smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """The shared tiny models plus `MQA`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TINY_VARIANTS, "qwen2-mqa", MQA)
        mqa = make_tiny_model(tmp_path_factory.mktemp("tp"), "qwen2-mqa", smollm2_dir)
    return {**tiny_models, "qwen2-mqa": mqa}


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("lmnb-tp-")]


def _run(folder: Path, tp_size: int, **options) -> list[dict]:
    """One prompt, then a batch sharing its prefix (cache hits), then prompt logprobs."""
    with Runtime(folder, tp_size=tp_size, **OPTIONS, **options) as rt:
        assert len(_workers()) == tp_size - 1
        first = rt.generate(PREFIX + QUESTIONS[0], GREEDY)
        batch = rt.generate([PREFIX + q for q in QUESTIONS[1:]], GREEDY)
        scored = rt.generate(PREFIX + QUESTIONS[0], {**GREEDY, "max_new_tokens": 2},
                             return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
        stats = rt.stats()
        assert stats["tp_size"] == tp_size
        assert (stats["overlapped_passes"] > 0) == (options.get("disable_overlap_schedule")
                                                    is False)
    assert _workers() == []
    return [first, *batch, scored]


@pytest.mark.parametrize(("variant", "overlap"), [("llama-mha", False), ("llama-gqa", True),
                                                 ("qwen2-mqa", False)])
def test_tp2_gives_tp1_tokens(models, variant: str, overlap: bool) -> None:
    """KV heads 4 (2 a rank), 2 (1 a rank, tied embeddings), 1 (`MQA`); with the overlap
    schedule, a decode pass is broadcast before the previous one's tokens reach the host."""
    expected = _run(models[variant], 1)
    got = _run(models[variant], 2, disable_overlap_schedule=not overlap)
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    assert all(g["meta_info"]["cached_tokens"] > 0 for g in got[1:])  # prefix-cache hits
    scores = got[-1]["meta_info"]["input_token_logprobs"][1:]
    reference = expected[-1]["meta_info"]["input_token_logprobs"][1:]
    assert [s[1] for s in scores] == [r[1] for r in reference]
    assert max(abs(s[0] - r[0]) for s, r in zip(scores, reference, strict=True)) < 1e-4


def _shards(folder: Path, *, dummy: bool) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    config = loader.load_model_config(folder)
    load = dict(dtype=torch.float32, device=torch.device("cpu"), dummy=dummy)
    full = loader.load_model(None if dummy else folder, config, **load)
    shards = [loader.load_model(None if dummy else folder, config,
                                tp=SimpleNamespace(rank=rank, size=2), **load)
              for rank in range(2)]
    return full, shards


@pytest.mark.parametrize("dummy", [False, True])
def test_shards_are_slices_of_the_model(models, dummy: bool) -> None:
    """Each rank's parameters are its slices of the TP=1 model, from the checkpoint (read lazily)
    or drawn at random (so random-weight benchmarks compare the same model)."""
    full, shards = _shards(models["qwen2-mqa"], dummy=dummy)
    config = full.config
    dim = config.head_dim
    f = dict(full.named_parameters())
    for rank, shard in enumerate(shards):
        s = dict(shard.named_parameters())
        assert s.keys() == f.keys()
        heads = head_split(config.num_heads, config.num_kv_heads, rank=rank, size=2)
        assert (heads.q_heads, heads.kv_start, heads.kv_heads) == (2, 0, 1)  # 1 KV head, shared
        q, kv = config.num_heads * dim, config.num_kv_heads * dim
        qkv = f["model.layers.0.self_attn.qkv_proj.weight"]
        expected = torch.cat((qkv[rank * q // 2:(rank + 1) * q // 2], qkv[q:q + kv],
                              qkv[q + kv:]))
        assert torch.equal(s["model.layers.0.self_attn.qkv_proj.weight"], expected)
        bias = f["model.layers.0.self_attn.qkv_proj.bias"]
        assert torch.equal(s["model.layers.0.self_attn.qkv_proj.bias"],
                           torch.cat((bias[rank * q // 2:(rank + 1) * q // 2], bias[q:])))
        o = f["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(s["model.layers.1.self_attn.o_proj.weight"],
                           o[:, rank * q // 2:(rank + 1) * q // 2])
        inter = config.intermediate_size // 2
        gate_up = f["model.layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(s["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat((gate_up[rank * inter:(rank + 1) * inter],
                                      gate_up[config.intermediate_size + rank * inter:
                                              config.intermediate_size + (rank + 1) * inter])))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            per_rank = (config.vocab_size + 1) // 2
            rows = f[name][rank * per_rank:(rank + 1) * per_rank]
            assert s[name].shape[0] == per_rank
            assert torch.equal(s[name][:len(rows)], rows)
            assert not s[name][len(rows):].any()  # the last shard's padding rows are zeros
        assert torch.equal(s["model.norm.weight"], f["model.norm.weight"])


def test_tp_checks_the_model_before_starting_workers(models) -> None:
    with pytest.raises(ValueError, match="tp_size=3 does not divide the model's 4 attention"):
        Runtime(models["llama-gqa"], tp_size=3, max_total_tokens=256)
    assert _workers() == []


def test_worker_failing_to_start_is_a_clear_error(models, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:load")
    with pytest.raises(TPError, match=r"worker rank 1 .* exited with code 1(.|\n)*fault injected"):
        Runtime(models["llama-gqa"], tp_size=2, max_total_tokens=256)
    assert _workers() == []


def test_dead_worker_is_a_clear_error_and_a_new_runtime_works(models) -> None:
    folder = models["llama-gqa"]
    rt = Runtime(folder, tp_size=2, **OPTIONS)
    expected = rt.generate(PREFIX, GREEDY)["output_ids"]
    (worker,) = _workers()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(TPError, match="worker rank 1 .* killed by signal 9"):
        rt.generate(PREFIX, GREEDY)
    assert rt.failed
    rt.close()
    assert _workers() == []
    with Runtime(folder, tp_size=2, **OPTIONS) as again:
        assert again.generate(PREFIX, GREEDY)["output_ids"] == expected


def test_workers_exit_when_their_parent_dies(models) -> None:
    """A kernel restart kills rank 0 without `close()`: its workers must not outlive it."""
    script = (
        "import multiprocessing, sys\n"
        "from lmnb.runtime.engine import Runtime\n"
        f"rt = Runtime({str(models['llama-gqa'])!r}, tp_size=2, max_total_tokens=256)\n"
        "print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
        "sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = parent.stdout.readline()
        assert line.strip(), "the parent process failed to start its Runtime"
        (worker_pid,) = map(int, line.split())
        try:
            worker = os.pidfd_open(worker_pid)
        except ProcessLookupError:
            pytest.fail("the worker exited while its parent was alive")
    finally:
        parent.kill()
        parent.wait()
    try:  # readable once the worker has exited (60 s: a safety net, not a synchronisation)
        readable, _, _ = select.select([worker], [], [], 60)
        assert readable, f"worker {worker_pid} outlived its parent"
    finally:
        os.close(worker)
