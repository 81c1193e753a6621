"""KV pool sized by the profile run on a CUDA device: the plan's numbers add up, the largest
prefill chunk and a full decode batch with the heaviest sampling then run without running out of
memory, within what the plan reserved; `mem_fraction_static` keeps SGLang's meaning."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lmnb.runtime.engine import Runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GIB = 1 << 30
CHUNK = 8192  # the CUDA default chunked_prefill_size
MAX_RUNNING = 128
HEAVY = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "frequency_penalty": 0.1,
         "presence_penalty": 0.1, "repetition_penalty": 1.1, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, smollm2_dir) -> Path:
    """A config-only small Llama (random weights through load_format='dummy')."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="bfloat16")
    target = tmp_path_factory.mktemp("small_llama")
    config.save_pretrained(target)
    for file in smollm2_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, target / file.name)
    return target


def _planned_bytes(memory: dict) -> float:
    return GIB * (memory["weights_gb"] + memory["fixed_gb"] + memory["kv_gb"]
                  + memory["activations_peak_gb"] + memory["cuda_graph_reserve_gb"])


def test_profiled_pool_leaves_room_for_the_largest_passes(small_model) -> None:
    torch.cuda.empty_cache()
    with Runtime(small_model, device="cuda", load_format="dummy", dtype="bfloat16",
                 max_running_requests=MAX_RUNNING) as rt:
        stats = rt.stats()
        memory = stats["memory"]
        print("memory plan:", memory, "graphs:", stats["cuda_graph_batch_sizes"][-1:],
              "capture s:", stats["cuda_graph_capture_seconds"])
        assert memory["kv_tokens"] == rt.max_total_tokens
        assert memory["activations_peak_gb"] > 0 and memory["cuda_graph_reserve_gb"] > 0
        assert memory["mem_fraction_static"] is None
        assert (_planned_bytes(memory) + GIB * memory["margin_gb"]
                <= GIB * memory["total_gb"] + 0.01 * GIB)
        # Nearly the whole device is planned for: the pool is not a fixed fraction of it.
        free, total = torch.cuda.mem_get_info()
        assert free < 2 * GIB * memory["margin_gb"] + 2 * GIB, (free, memory)

        torch.cuda.reset_peak_memory_stats()
        long_prompt = [(37 * i) % 49000 + 3 for i in range(CHUNK + 100)]  # a full chunk + more
        out = rt.generate(input_ids=long_prompt,
                          sampling_params={**HEAVY, "max_new_tokens": 4},
                          return_logprob=True, top_logprobs_num=5)
        assert len(out["output_ids"]) == 4
        prompts = [[(11 * i + j) % 49000 + 3 for j in range(16)] for i in range(MAX_RUNNING)]
        outs = rt.generate(input_ids=prompts, sampling_params={**HEAVY, "max_new_tokens": 24},
                           return_logprob=True, top_logprobs_num=5)
        assert all(len(o["output_ids"]) == 24 for o in outs)
        rt.check_integrity()
        peak = torch.cuda.max_memory_reserved()
        print(f"peak reserved {peak / GIB:.3f} GB, planned {_planned_bytes(memory) / GIB:.3f} GB")
        # What torch held at its peak stays within the plan, give or take half the margin.
        assert peak <= _planned_bytes(memory) + GIB * memory["margin_gb"] / 2


def test_mem_fraction_static_keeps_sglang_meaning(small_model) -> None:
    torch.cuda.empty_cache()
    with Runtime(small_model, device="cuda", load_format="dummy", dtype="bfloat16",
                 max_running_requests=MAX_RUNNING, mem_fraction_static=0.5) as rt:
        memory = rt.stats()["memory"]
        out = rt.generate(input_ids=[5] * 300, sampling_params={**HEAVY, "max_new_tokens": 8})
        assert len(out["output_ids"]) == 8
    assert memory["mem_fraction_static"] == 0.5
    assert memory["weights_gb"] + memory["kv_gb"] <= 0.5 * memory["total_gb"] + 0.01
    assert memory["kv_gb"] > 0.3 * memory["total_gb"]  # the device is otherwise empty


def test_mem_fraction_static_that_starves_activations_is_refused(small_model) -> None:
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="mem_fraction_static"):
        Runtime(small_model, device="cuda", load_format="dummy", dtype="bfloat16",
                max_running_requests=MAX_RUNNING, mem_fraction_static=0.999)
