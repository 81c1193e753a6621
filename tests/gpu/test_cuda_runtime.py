"""The runtime on a CUDA device: the same tokens as HF on the same device, in fp32 and bf16."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmnb.runtime.engine import Runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 300))] for _ in range(count)]


def _hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), device="cuda"))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_greedy_on_cuda_matches_hf_fp32(tiny_models, variant):
    folder = tiny_models[variant]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(12, seed=1)
    expected = [_hf_greedy(hf, ids, 16) for ids in prompts]
    with Runtime(folder, device="cuda", dtype="float32", max_total_tokens=16384,
                 check_integrity_each_step=True) as rt:
        outs = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, **GREEDY})
        assert [out["output_ids"] for out in outs] == expected
        again = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, **GREEDY})
        assert [out["output_ids"] for out in again] == expected  # now with cache hits
        assert all(out["meta_info"]["cached_tokens"] > 0 for out in again)
        rt.check_integrity()


def test_bf16_prefill_logprobs_close_to_fp32(tiny_models):
    folder = tiny_models["llama-gqa"]
    prompt = _prompts(1, seed=2)[0]
    values = {}
    for dtype in ("float32", "bfloat16"):
        with Runtime(folder, device="cuda", dtype=dtype, max_total_tokens=4096) as rt:
            out = rt.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1},
                              return_logprob=True, logprob_start_len=1)
            values[dtype] = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"]])
    assert (values["float32"] - values["bfloat16"]).abs().mean() < 0.05


def test_constrained_decoding_on_cuda(tiny_models):
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}|(yes|no)!"
    with Runtime(tiny_models["llama-gqa"], device="cuda", max_total_tokens=4096) as rt:
        outs = rt.generate(input_ids=_prompts(16, seed=3), sampling_params={
            "regex": pattern, "temperature": 1.0, "seed": 0, "max_new_tokens": 24})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(pattern, out["text"])
