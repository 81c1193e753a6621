"""A pass's launch enqueues its work and returns: nothing in it waits for the device (a blocking
host-to-device copy, `.item()`, a CUDA tensor indexed by a Python list), so the scheduler plans
the next pass while this one runs. Checked with torch's sync debug mode raising inside every
`ModelRunner.launch` of extend and decode passes, with penalties, min_new_tokens and a grammar."""

from __future__ import annotations

import random

import pytest
import torch

from lmnb.runtime.engine import Runtime
from lmnb.runtime.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_no_launch_waits_for_the_device(tiny_models, monkeypatch):
    launches: list[str] = []
    original = ModelRunner.launch

    def launch_raising_on_sync(self, batch, rows):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = original(self, batch, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launches.append(batch.mode.name)
        return step

    monkeypatch.setattr(ModelRunner, "launch", launch_raising_on_sync)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 49152) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(5, 60))]
               for _ in range(8)]
    plain = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Runtime(tiny_models["llama-gqa"], device="cuda", dtype="float32",
                 max_total_tokens=16384, chunked_prefill_size=256) as rt:
        rt.generate(input_ids=prompts, sampling_params=plain)
        rt.generate(input_ids=prompts[:4], sampling_params=[
            {**plain, "repetition_penalty": 1.3},
            {**plain, "frequency_penalty": 0.5, "presence_penalty": 0.2},
            {**plain, "min_new_tokens": 3, "ignore_eos": False},
            {**plain, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3}])
        rt.generate(input_ids=prompts[:2], sampling_params={
            "max_new_tokens": 8, "temperature": 0, "regex": "[ab]{3,8}"})
        rt.check_integrity()
    assert "EXTEND" in launches and "DECODE" in launches
