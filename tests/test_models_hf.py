"""Our Llama-family implementation against HF transformers (fp32, CPU): logits and greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.engine import Runtime
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from tests.conftest import TINY_VARIANTS

VARIANTS = sorted(TINY_VARIANTS)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    return {v: AutoModelForCausalLM.from_pretrained(tiny_models[v], dtype=torch.float32).eval()
            for v in VARIANTS}


def _hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_hf(variant, tiny_models, hf_models):
    folder = tiny_models[variant]
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))
    engine_config = EngineConfig(max_total_tokens=512, max_running_requests=4,
                                 attention_backend="torch_native")
    runner = ModelRunner(model, config, engine_config, device=torch.device("cpu"),
                         dtype=torch.float32, eos_token_ids={2})
    prompts = _prompts(3, seed=1)
    pool_indices = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(ids) for ids in prompts]
    slots = KVAllocator(512, torch.device("cpu")).alloc(sum(lens))
    start = 0
    for pool_index, n in zip(pool_indices, lens, strict=True):
        runner.req_to_token_pool.req_to_token[pool_index, :n] = slots[start:start + n]
        start += n
    batch = Batch(mode=ForwardMode.EXTEND, rids=[0, 1, 2], req_pool_indices=pool_indices,
                  prefix_lens=[0] * 3, extend_lens=lens,
                  input_ids=[t for ids in prompts for t in ids], out_cache_loc=slots,
                  samples=[False] * 3)
    with torch.inference_mode():
        forward_batch = runner.forward_batch(batch)
        runner.attn_backend.init_forward_metadata(forward_batch)
        logits = model.compute_logits(model(forward_batch.input_ids, forward_batch.positions,
                                            forward_batch))
    start = 0
    for ids in prompts:
        with torch.no_grad():
            expected = hf_models[variant](torch.tensor([ids])).logits[0]
        got = logits[start:start + len(ids)]
        start += len(ids)
        relative = (got - expected).abs().max() / expected.abs().max()
        assert relative < 1e-4, f"{variant}: relative logit error {relative:.2e}"


# "mistral" decodes through llama-gqa's path (its config and weights: test_prefill_logits_match_hf).
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "mistral"])
def test_greedy_matches_hf_generate_alone_and_in_a_batch(variant, tiny_models, hf_models):
    prompts = _prompts(16, seed=2)
    new_tokens = [random.Random(i).randint(4, 24) for i in range(len(prompts))]
    expected = [_hf_greedy(hf_models[variant], ids, n)
                for ids, n in zip(prompts, new_tokens, strict=True)]
    with Runtime(tiny_models[variant], check_integrity_each_step=True,
                 max_total_tokens=4096) as rt:
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in new_tokens]
        batched = rt.generate(input_ids=prompts, sampling_params=params)
        assert [out["output_ids"] for out in batched] == expected
        for ids, n, want in list(zip(prompts, new_tokens, expected, strict=True))[:4]:
            alone = rt.generate(input_ids=ids, sampling_params={
                "max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            assert alone["output_ids"] == want
        rt.check_integrity()


def test_retraction_under_tiny_pool_keeps_tokens_exact(tiny_models, hf_models):
    variant = "llama-gqa"
    prompts = _prompts(8, seed=3)
    expected = [_hf_greedy(hf_models[variant], ids, 30) for ids in prompts]
    # A stop id none of the outputs holds: as far as the scheduler knows each request may stop
    # early, so admission reserves an estimate and the tight pool retracts (requests that only
    # the length limit ends are admitted by their exact peak and never retracted).
    never = min(set(range(1000)) - {token for out in expected for token in out})
    with Runtime(tiny_models[variant], check_integrity_each_step=True, max_total_tokens=128,
                 chunked_prefill_size=24) as rt:
        outs = rt.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [never]})
        assert [out["output_ids"] for out in outs] == expected
        assert rt.stats()["retractions"] > 0
        rt.check_integrity()
        stats = rt.stats()
        assert stats["free_tokens"] + stats["evictable_tokens"] == 128  # nothing held


def test_a_windowed_model_is_served_up_to_its_window(tiny_models, tmp_path):
    """A Mistral with a 24-token sliding window: lmnb's full attention equals HF's windowed one
    within the window, which bounds the context; a longer prompt is a clear error."""
    import json
    import shutil

    from lmnb.params import InvalidRequestError

    folder = tmp_path / "mistral-window"
    shutil.copytree(tiny_models["mistral"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 24}))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 24
    prompt = _prompts(1, seed=5)[0][:12]
    with Runtime(folder, dtype="float32", device="cpu", max_total_tokens=512) as rt:
        assert rt.context_len == 24
        out = rt.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12,
                                                             "temperature": 0})
        assert out["output_ids"] == _hf_greedy(hf, prompt, 12)
        with pytest.raises(InvalidRequestError, match="context length is 24"):
            rt.generate(input_ids=list(range(3, 30)), sampling_params={"max_new_tokens": 1})
