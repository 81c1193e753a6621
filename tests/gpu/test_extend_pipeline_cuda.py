"""Pipelined prefill passes on a CUDA device: a pass's prompts enter the radix tree when it is
launched and the next pass (reading that KV) is launched before its results are processed; the
greedy tokens are HF's and those of the synchronous schedule."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmnb.runtime.engine import Runtime
from tests.gpu.test_cuda_runtime import GREEDY, _hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pipelined_prefill_passes_match_hf_and_the_synchronous_schedule(tiny_models):
    folder = tiny_models["llama-gqa"]
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 49152) for _ in range(300)] for _ in range(3)]
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(5, 40))]
               for prefix in prefixes for _ in range(6)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    sample = prompts[::4]
    expected = [_hf_greedy(hf, ids, 8) for ids in sample]
    outputs = {}
    for disable in (False, True):
        with Runtime(folder, device="cuda", dtype="float32", max_total_tokens=16384,
                     chunked_prefill_size=256, disable_overlap_schedule=disable,
                     check_integrity_each_step=True) as rt:
            outs = rt.generate(input_ids=prompts,
                               sampling_params={"max_new_tokens": 8, **GREEDY})
            stats = rt.stats()
            rt.check_integrity()
        outputs[disable] = [out["output_ids"] for out in outs]
        assert (stats["overlapped_prefill_passes"] > 0) is (not disable)
        assert sum(out["meta_info"]["cached_tokens"] >= 256 for out in outs) >= 12
    assert outputs[False] == outputs[True]
    assert outputs[False][::4] == expected
