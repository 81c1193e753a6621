"""The floor of a run's own schedule (bench/floor.py): the scheduler's batch hook records what ran,
and the floor adds up each pass's bytes and FLOPs as the model's shapes say."""

from __future__ import annotations

import torch

from bench.floor import BatchLog, ModelCost, schedule_floor
from lmnb.runtime.config import ModelConfig
from lmnb.runtime.core import ForwardMode
from lmnb.runtime.engine import Runtime

CONFIG = ModelConfig(architecture=None, model_type="llama", num_layers=2, hidden_size=8,
                     intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4,
                     vocab_size=100, max_position_embeddings=64)


def test_the_batch_hook_sees_every_pass_the_scheduler_ran(tiny_models):
    log = BatchLog()
    with Runtime(tiny_models["llama-gqa"], max_total_tokens=512) as rt:
        rt.set_batch_hook(log)
        rt.generate(input_ids=[list(range(10, 15)), list(range(20, 29))],
                    sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        rt.set_batch_hook(None)
        rt.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert log.passes == [
        (ForwardMode.EXTEND, [0, 0], [5, 9], 2),
        (ForwardMode.DECODE, [5, 9], [1, 1], 2),
        (ForwardMode.DECODE, [6, 10], [1, 1], 2),
        (ForwardMode.DECODE, [7, 11], [1, 1], 2),
    ]


def test_pass_costs_follow_the_shapes():
    cost = ModelCost.from_config(CONFIG, torch.float16)
    # per layer: qkv 8*(2+2)*4 + o 8*8 + gate/up/down 3*8*16 = 128 + 64 + 384
    assert cost.linear_params == 2 * 576
    assert cost.head_params == 800
    assert cost.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    assert cost.attn_flops_per_pair == 4 * 2 * 2 * 4
    # Decode of two requests with 5 and 9 cached tokens, both sampling.
    data_bytes, flops = cost.pass_cost([5, 9], [1, 1], sampled=2)
    weights = (2 * 576 + 800) * 2 + 5 * 8 * 2 + 2 * 8 * 2  # linears + head, norms, 2 embed rows
    assert data_bytes == weights + 32 * (16 + 2)  # KV read (6 + 10) and written (2)
    assert flops == 2 * 1152 * 2 + 2 * 800 * 2 + 64 * (6 + 10)
    # Prefill of 3 new tokens after 4 cached ones: pairs 5 + 6 + 7; one sampled row.
    _, flops = cost.pass_cost([4], [3], sampled=1)
    assert flops == 2 * 1152 * 3 + 2 * 800 + 64 * 18


def test_schedule_floor_sums_the_bound_of_each_pass():
    cost = ModelCost.from_config(CONFIG, torch.float16)
    log = BatchLog()
    log.passes = [(ForwardMode.EXTEND, [0], [3], 1), (ForwardMode.DECODE, [3], [1], 1)]
    extend_bytes, extend_flops = cost.pass_cost([0], [3], 1)
    decode_bytes, decode_flops = cost.pass_cost([3], [1], 1)
    floor = schedule_floor(log, cost, copy_bytes_per_s=1e3, matmul_flops_per_s=1e6)
    assert floor["extend_passes"] == floor["decode_passes"] == 1
    assert floor["decode_seconds"] == max(decode_bytes / 1e3, decode_flops / 1e6)
    assert floor["extend_seconds"] == max(extend_bytes / 1e3, extend_flops / 1e6)
    assert floor["seconds_issue_definition"] == floor["decode_seconds"] + extend_flops / 1e6
    assert floor["decode_memory_bound_passes"] == 1  # tiny model, slow copy: bytes win
    assert floor["decode_tokens"] == 1 and floor["extend_tokens"] == 3
