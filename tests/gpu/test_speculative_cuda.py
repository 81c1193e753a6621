"""Speculative decoding on CUDA: greedy outputs token for token those without speculation (fp32,
tiny model), with CUDA graphs, the overlap schedule and the Triton / torch-native backends. Every
verify pass replays a decode graph (its rows, `speculative/rows.py`: decode graphs capped at 8
requests still reach the 5 x 8 rows of these verify passes), and so do STANDALONE's draft
catch-up passes. KV integrity checked after every step."""

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
    assert stats["cuda_graph_batch_sizes"][-1] == 64 and stats["overlap_schedule"]
    verifies = stats["speculative"]["timed_passes"]["verify"]
    assert verifies > 0 and stats["verify_graph_replays"] == verifies


def test_graphed_verify_matches_eager_verify_on_cuda(tiny_models) -> None:
    """The same NGRAM run with verify passes replaying decode graphs and as eager EXTENDs
    (`speculative_verify_mode="extend"`): the same tokens, the same verify passes."""
    options = dict(device="cuda", dtype="float32", max_total_tokens=8192, context_length=512,
                   check_integrity_each_step=True, speculative_algorithm="NGRAM",
                   speculative_num_draft_tokens=12, speculative_draft_policy="always",
                   speculative_min_accept_rate=0.0)
    path = str(tiny_models["llama-gqa"])
    runs = {}
    for mode in ("auto", "extend"):
        with Runtime(path, **options, speculative_verify_mode=mode) as rt:
            outs = [rt.generate(prompt, GREEDY) for prompt in COPY]  # batch 1, k up to 11
            runs[mode] = (outs, rt.stats())
    (graphed, stats), (eager, eager_stats) = runs["auto"], runs["extend"]
    assert [o["output_ids"] for o in graphed] == [o["output_ids"] for o in eager]
    verifies = stats["speculative"]["timed_passes"]["verify"]
    assert verifies == eager_stats["speculative"]["timed_passes"]["verify"] > 0
    assert stats["verify_graph_replays"] == verifies
    assert eager_stats["verify_graph_replays"] == 0


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
        all_stats = rt.stats()
    stats = all_stats["speculative"]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert stats["accept_rate"] > 0.9 and stats["draft_kv_tokens"] == 0
    assert stats["draft_row_passes"] > 0  # catch-up passes replayed the draft's decode graphs
    assert all_stats["verify_graph_replays"] == stats["timed_passes"]["verify"] > 0


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_verify_rows_replay_captured_graphs_and_match_extend(tiny_models, backend: str) -> None:
    """Verify passes of 1, 3 and 8 requests x up to 11 drafts (speculative_num_draft_tokens 12)
    as decode rows: decode graphs capped at 8 requests reach the 96 rows, every pass replays a
    captured graph (the shared-prefix variant where a prefix is long, Triton), its logits are the
    eager EXTEND's, and nothing before the replay waits for the device."""
    from tests.test_verify_rows import NUM_DRAFT_TOKENS, check_verify_rows, verify_rows_runner

    runner = verify_rows_runner(tiny_models["llama-gqa"], device=torch.device("cuda"),
                                attention_backend=backend, max_batch=8)
    assert runner.graph_max_bs == 8 * NUM_DRAFT_TOKENS
    runner.capture_cuda_graphs(runner.graph_max_bs)
    assert runner.graph_runner is not None and runner.graph_runner.ladder[-1] == 96
    assert check_verify_rows(runner, max_batch=8, no_sync=True) == 3
    runner.close()
