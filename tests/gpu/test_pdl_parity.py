"""Programmatic dependent launch (kernels/pdl.py) changes when kernels start, never what they
compute: a model of Llama-3-8B's layer shapes (4 layers, seeded random weights) decodes the same
greedy tokens with bitwise the same logprobs with PDL and without (`LMNB_DISABLE_PDL=1`), under
CUDA graphs, with bf16 and FP8 weights, at batch 1 (the FMA GEMVs) and 8 (the dot path).

The real sizes are the point: a kernel that reads before its wait what the kernel in front of it
writes races only when that kernel runs long enough to still be writing (several waves). A tiny
model's kernels finish before the next one is scheduled, so the engine tests cannot see it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bench.dummy_models import DUMMY_CONFIGS
from lmnb.runtime.engine import Runtime
from lmnb.runtime.kernels import pdl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LLAMA_3_8B_LAYERS = {**DUMMY_CONFIGS["llama-3-8b"], "num_hidden_layers": 4}
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def llama_3_8b_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-3-8b-4-layers")
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B_LAYERS))
    return folder


def _decode(folder: Path, tokenizer: Path, prompts: list[list[int]],
            quantization: str | None) -> list[dict]:
    options = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_total_tokens=16384,
                   context_length=1024, attention_backend="triton", max_running_requests=8,
                   tokenizer_path=str(tokenizer))  # ids in, ids out
    if quantization is not None:
        options["quantization"] = quantization
    with Runtime(folder, **options) as rt:
        out = rt.generate(input_ids=prompts if len(prompts) > 1 else prompts[0],
                          sampling_params=GREEDY, return_logprob=True)
        rt.check_integrity()
    return out if isinstance(out, list) else [out]


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("batch", [1, 8])
def test_pdl_changes_no_result(llama_3_8b_layers, smollm2_dir, monkeypatch, quantization, batch):
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0 (and LMNB_DISABLE_PDL unset)")
    if quantization == "fp8" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 weights need Hopper")
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 128000) for _ in range(rng.randint(100, 400))]
               for _ in range(batch)]
    with_pdl = _decode(llama_3_8b_layers, smollm2_dir, prompts, quantization)
    monkeypatch.setenv("LMNB_DISABLE_PDL", "1")
    assert not pdl.enabled(torch.device("cuda"))
    without = _decode(llama_3_8b_layers, smollm2_dir, prompts, quantization)
    for mine, theirs in zip(with_pdl, without, strict=True):
        assert mine["output_ids"] == theirs["output_ids"]
        assert (mine["meta_info"]["output_token_logprobs"]
                == theirs["meta_info"]["output_token_logprobs"])
