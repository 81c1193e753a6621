"""Decode through CUDA graphs: the same greedy tokens as eager decode (fp32), close in bf16,
padded batch sizes of the ladder included."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmnb.runtime.engine import Runtime
from lmnb.runtime.graph_runner import batch_size_ladder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 200))] for _ in range(count)]


def test_ladder() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_ladder(64)[-3:] == [48, 56, 64]
    assert batch_size_ladder(256)[-4:] == [208, 224, 240, 256]
    assert batch_size_ladder(130) == [1, 2, 4, *range(8, 129, 8), 130]


@pytest.mark.parametrize(("dtype", "backend"), [("float32", "torch_native"),
                                                ("bfloat16", "torch_native"),
                                                ("float32", "auto"), ("bfloat16", "auto")])
def test_graph_decode_matches_eager(tiny_models, dtype: str, backend: str) -> None:
    folder = tiny_models["llama-gqa"]
    prompts = _prompts(11, seed=3)  # 11 requests: replays pad up to the ladder's 16
    options = dict(device="cuda", dtype=dtype, max_total_tokens=8192, context_length=512,
                   attention_backend=backend, max_running_requests=16)
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
    with Runtime(folder, disable_cuda_graph=True, **options) as eager:
        expected = eager.generate(input_ids=prompts, sampling_params={**GREEDY,
                                                                      "max_new_tokens": 24})
    graph_options = dict(options)
    if backend == "torch_native":
        graph_options["cuda_graph_max_bs"] = 16
    with Runtime(folder, **graph_options) as graphed:
        stats = graphed.stats()
        if backend == "torch_native" or graphed.stats()["cuda_graph_batch_sizes"]:
            assert stats["cuda_graph_batch_sizes"][-1] == 16
        got = graphed.generate(input_ids=prompts, sampling_params={**GREEDY,
                                                                   "max_new_tokens": 24})
        alone = graphed.generate(input_ids=prompts[0], sampling_params={**GREEDY,
                                                                       "max_new_tokens": 24})
        graphed.check_integrity()
    if dtype == "float32":
        assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
        assert alone["output_ids"] == expected[0]["output_ids"]
    else:  # bf16: rounding differs between eager and graph kernels; tokens mostly agree
        same = sum(a == b for g, e in zip(got, expected, strict=True)
                   for a, b in zip(g["output_ids"], e["output_ids"], strict=True))
        assert same >= 0.8 * sum(len(e["output_ids"]) for e in expected)


_COLD_START = """
import json, sys
from triton import knobs

compiles = []
knobs.runtime.jit_post_compile_hook = (
    lambda *, fn, is_manual_warmup, **_: compiles.append([fn.name, is_manual_warmup]))
import torch
from lmnb.runtime.engine import Runtime

torch.backends.cuda.matmul.allow_tf32 = False
prompts = json.loads(sys.argv[2])
options = dict(device="cuda", dtype="float32", context_length=512, attention_backend="triton",
               max_running_requests=16, **json.loads(sys.argv[3]))
params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
with Runtime(sys.argv[1], **options) as rt:
    start = list(compiles)
    precompiled = rt.stats()["cuda_graph_precompiled_kernels"]
    got = [o["output_ids"] for o in rt.generate(input_ids=prompts, sampling_params=params)]
with Runtime(sys.argv[1], **options) as again:  # this process has them all: nothing recorded
    again_precompiled = again.stats()["cuda_graph_precompiled_kernels"]
with Runtime(sys.argv[1], disable_cuda_graph=True, **options) as eager:
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts,
                                                         sampling_params=params)]
print("RESULT", json.dumps({"start": start, "precompiled": precompiled, "got": got,
                            "expected": expected, "again": again_precompiled}))
"""


def _cold_start(folder, tmp_path, options: dict) -> dict:
    """`_COLD_START` in a fresh process with an empty Triton cache: what it compiled while the
    engine started ([kernel, compiled by a warm-up], in order) and the tokens."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _COLD_START, str(folder),
                           json.dumps(_prompts(11, seed=5)), json.dumps(options)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def test_a_cold_start_compiles_the_graphs_kernels_side_by_side(tiny_models, tmp_path) -> None:
    """With an empty Triton cache every kernel the decode graphs launch is compiled by the
    side-by-side pass (Triton's warm-up compiles), none at capture, and the graphs decode the
    greedy tokens of eager decode (fp32). A given KV size: no memory profile."""
    result = _cold_start(tiny_models["llama-gqa"], tmp_path, {"max_total_tokens": 8192})
    start = result["start"]
    first = next(i for i, (_, warm_up) in enumerate(start) if warm_up)
    assert len(start[first:]) == result["precompiled"] > 0
    assert all(warm_up for _, warm_up in start[first:]), start  # nothing compiled at capture
    assert "_decode_partial_kernel" in {name for name, _ in start[first:]}
    assert result["again"] == 0
    assert result["got"] == result["expected"]


def test_a_cold_start_compiles_the_memory_profiles_passes_side_by_side(tiny_models,
                                                                      tmp_path) -> None:
    """The KV pool sized by the memory profile: its passes' kernels (the prefill attention and
    the sampler's heaviest path among them) compile in their side-by-side pass, none at first
    launch while the engine starts, and the engine decodes eager's greedy tokens."""
    result = _cold_start(tiny_models["llama-gqa"], tmp_path, {"mem_fraction_static": 0.3})
    assert all(warm_up for _, warm_up in result["start"]), result["start"]
    warm_ups = {name for name, _ in result["start"]}
    assert {"_extend_kernel", "_decode_partial_kernel", "_digits_kernel",
            "_packed_logprobs_kernel"} <= warm_ups, result["start"]
    assert result["got"] == result["expected"]
