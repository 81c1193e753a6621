"""`token_ids_logprob` on a CUDA device, where the sampler's logprobs come from its Triton kernel
and decode runs in CUDA graphs: the named ids' logprobs equal HF's log_softmax on the same device
(fp32), and equal the top logprobs the kernel reports for the same ids, batched beside requests
that name none, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmnb.runtime.engine import Runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 2e-4


def test_named_ids_logprobs_on_cuda_match_hf_and_the_top_logprobs(tiny_models):
    folder = tiny_models["llama-gqa"]
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with Runtime(folder, device="cuda", dtype="float32", max_total_tokens=8192,
                 check_integrity_each_step=True) as rt:
        prompt = rt.encode("Named ids on the GPU: one two three four")
        ids = [5, rt.model_config.vocab_size - 1, prompt[2], 5]
        greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        sampled = {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True, "seed": 3}
        outs = rt.generate(input_ids=[prompt, prompt[:-2], prompt[1:]],
                           sampling_params=[greedy, greedy, sampled], return_logprob=True,
                           top_logprobs_num=4, token_ids_logprob=[ids, None, None])
        out = outs[0]
        meta = out["meta_info"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out["output_ids"]], device="cuda")).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        rows = meta["output_token_ids_logprobs"]
        assert len(rows) == len(out["output_ids"]) == 8
        for i, row in enumerate(rows):
            assert [t for _, t in row] == ids
            for value, token in row:
                assert abs(value - ref[len(prompt) - 1 + i, token].item()) < TOL
        # the kernel's top logprobs, asked again as named ids in a second request
        tops = meta["output_top_logprobs"]
        top_ids = [t for _, t in tops[0]]
        again = rt.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1},
                            return_logprob=True, token_ids_logprob=top_ids)
        named = again["meta_info"]["output_token_ids_logprobs"][0]
        assert again["meta_info"]["cached_tokens"] > 0
        for (value, token), (top_value, top_token) in zip(named, tops[0], strict=True):
            assert token == top_token and abs(value - top_value) < TOL
        assert all("output_token_ids_logprobs" not in other["meta_info"] for other in outs[1:])
        rt.check_integrity()
