"""NGRAM speculative decoding on CUDA: greedy outputs token for token those without speculation
(fp32, tiny model), with CUDA graphs for the decode passes, the overlap schedule and the Triton
backend; verify passes run eagerly. KV integrity checked after every step."""

from __future__ import annotations

import random

import pytest
import torch

from lmnb.runtime.engine import Runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

COPY = ["apple banana cherry apple banana cherry apple banana cherry apple banana",
        '{"a": 1, "b": 2, "c": 3}\n{"a": 1, "b": 2, "c": 3}\n{"a": 1,',
        # over 64 tokens: its verify rows read the prefix once (shared-prefix decode)
        " ".join(["red green blue yellow"] * 20)]
_rng = random.Random(5)
RANDOM = [" ".join(str(_rng.randint(0, 9999)) for _ in range(24)) for _ in range(2)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 64}


@pytest.mark.parametrize("backend", ["torch_native", "auto"])
def test_ngram_greedy_matches_plain_decode_on_cuda(tiny_models, backend: str) -> None:
    options = dict(device="cuda", dtype="float32", max_total_tokens=8192, context_length=512,
                   attention_backend=backend, check_integrity_each_step=True,
                   cuda_graph_max_bs=8)
    path = str(tiny_models["llama-gqa"])
    with Runtime(path, **options) as rt:
        want = rt.generate(COPY + RANDOM, GREEDY)
        want_one = rt.generate(COPY[0], {**GREEDY, "stop": [want[0]["text"][20:24]]})
    with Runtime(path, **options, speculative_algorithm="NGRAM",
                 speculative_num_draft_tokens=8, speculative_draft_policy="always",
                 speculative_min_accept_rate=0.0) as rt:
        got = rt.generate(COPY + RANDOM, GREEDY)
        got_one = rt.generate(COPY[0], {**GREEDY, "stop": [want[0]["text"][20:24]]})
        stats = rt.stats()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert got_one["text"] == want_one["text"]
    assert stats["speculative"]["accepted_tokens"] > 0
    assert stats["cuda_graph_batch_sizes"] and stats["overlap_schedule"]


def test_standalone_draft_model_on_cuda(tiny_models) -> None:
    """STANDALONE with the target as its own draft (decode graphs for both models): drafts
    accepted (all but near-ties), the outputs of plain decoding."""
    options = dict(device="cuda", dtype="float32", max_total_tokens=8192, context_length=512,
                   check_integrity_each_step=True, cuda_graph_max_bs=8)
    path = str(tiny_models["llama-gqa"])
    with Runtime(path, **options) as rt:
        want = rt.generate(COPY + RANDOM, GREEDY)
    with Runtime(path, **options, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=path, speculative_num_steps=4,
                 speculative_draft_policy="always") as rt:
        got = rt.generate(COPY + RANDOM, GREEDY)
        stats = rt.stats()["speculative"]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert stats["accept_rate"] > 0.9 and stats["draft_kv_tokens"] == 0
