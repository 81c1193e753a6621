"""Verify passes as decode rows (`speculative/rows.py`) through the decode-graph path: batches of 1,
3 and `max_batch` requests with chains of the configured length (`speculative_num_draft_tokens`
12: 11 drafts) and mixed lengths, padded to the graph ladder, give the eager EXTEND's logits. On
the CPU (batches up to 4) the graph runner captures nothing (`capture=False`: the padded static
batch runs eagerly through the same replay hooks); `tests/gpu/test_speculative_cuda.py` runs the
same check on captured graphs with batches up to 8."""

from __future__ import annotations

import random

import torch

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.graph_runner import DecodeGraphRunner
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from lmnb.runtime.speculative.rows import decode_rows, last_rows

NUM_DRAFT_TOKENS = 12


def verify_rows_runner(folder, *, device: torch.device, attention_backend: str,
                       max_batch: int) -> ModelRunner:
    """A runner of the tiny model configured for NGRAM verify passes of up to `max_batch` x 12
    rows (decode graphs capped at `max_batch` requests)."""
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=device)
    engine = EngineConfig(max_total_tokens=4096, max_running_requests=max_batch,
                          context_length=256, attention_backend=attention_backend,
                          cuda_graph_max_bs=max_batch, speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
                          speculative_max_batch_size=max_batch)
    return ModelRunner(model, config, engine, device=device, dtype=torch.float32,
                       eos_token_ids={2})


def check_verify_rows(runner: ModelRunner, *, max_batch: int, seed: int = 0,
                      no_sync: bool = False) -> int:
    """Prefills `max_batch` requests (prompts of 3-90 tokens: some over the shared-prefix
    threshold), then verify-shaped passes of 1, 3 and `max_batch` of them: decode-row logits ==
    EXTEND logits. `no_sync` (CUDA): the rows pass up to its logits never waits for the device.
    Returns the replays."""
    graphs = runner.graph_runner
    assert graphs is not None
    device, vocab = runner.device, runner.vocab_size
    rng = random.Random(seed)
    allocator = KVAllocator(runner.max_total_tokens, device)
    pool = runner.req_to_token_pool
    reqs = [pool.alloc() for _ in range(max_batch)]
    prompt_lens = [rng.randint(3, 90) for _ in reqs]
    prompt_lens[0] = 80  # batch 1 reads a shared prefix where the backend can

    def batch(lens: list[int], starts: list[int], drafts: list[list[int]]) -> Batch:
        n = len(lens)
        slots = allocator.alloc(sum(lens))
        offset = 0
        for req, start, length in zip(reqs, starts, lens, strict=False):
            pool.req_to_token[req, start:start + length] = slots[offset:offset + length]
            offset += length
        return Batch(mode=ForwardMode.EXTEND, rids=list(range(n)), req_pool_indices=reqs[:n],
                     prefix_lens=starts, extend_lens=lens,
                     input_ids=[rng.randrange(3, vocab) for _ in range(sum(lens))],
                     out_cache_loc=slots, samples=[True] * n, input_logprobs=[None] * n,
                     mm_inputs=[None] * n, drafts=drafts)

    with torch.inference_mode():
        runner.position_logits(batch(prompt_lens, [0] * max_batch, []), last_rows(prompt_lens),
                               as_rows=False)
    replays = graphs.replays
    full = NUM_DRAFT_TOKENS - 1
    for size, chains in ((1, [full]), (3, [2, 5, full]), (max_batch, [full] * max_batch)):
        drafts = [[rng.randrange(3, vocab) for _ in range(k)] for k in chains]
        verify = batch([1 + k for k in chains], prompt_lens[:size], drafts)
        with torch.inference_mode():
            eager = runner.position_logits(verify, as_rows=False).clone()
            if no_sync:
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
            try:
                rows = runner.position_logits(verify, as_rows=True)
            finally:
                if no_sync:
                    torch.cuda.set_sync_debug_mode("default")
        assert rows.shape == eager.shape == (sum(chains) + size, rows.shape[1])
        torch.testing.assert_close(rows, eager, atol=2e-4, rtol=1e-3)
        allocator.free(verify.out_cache_loc)
        assert graphs.replays == replays + 1, "the rows pass did not replay the decode graph"
        replays = graphs.replays
    return replays


def test_decode_rows_layout() -> None:
    rows = decode_rows([5, 9], [70, 3], [3, 2], shared_prefix=True)
    assert rows.req_pool_indices == [5, 5, 5, 9, 9]
    assert rows.prefix_lens == [70, 71, 72, 3, 4]  # row j reads the request's KV up to s + j
    assert rows.shared_prefixes == [(70, [0, 1, 2])]  # a short prefix forms no group
    assert decode_rows([5], [70], [3], shared_prefix=False).shared_prefixes == []
    assert last_rows([3, 1, 4]) == [2, 3, 7]


def test_verify_rows_through_padded_static_buffers_equal_extend_on_cpu(tiny_models) -> None:
    device = torch.device("cpu")
    runner = verify_rows_runner(tiny_models["llama-gqa"], device=device,
                                attention_backend="torch_native", max_batch=4)
    assert runner.graph_max_bs == 0  # no CUDA graphs on the CPU; the same path without capture
    runner.graph_runner = DecodeGraphRunner(runner.model, runner.attn_backend,
                                            max_bs=4 * NUM_DRAFT_TOKENS, device=device,
                                            capture=False)
    assert runner.rows_replay(Batch(mode=ForwardMode.EXTEND, rids=[0], req_pool_indices=[0],
                                    prefix_lens=[0], extend_lens=[48], input_ids=[],
                                    out_cache_loc=torch.zeros(0), samples=[True]))
    assert check_verify_rows(runner, max_batch=4) == 3
    runner.close()
