"""The forward of a speculative verify pass alone, graphed vs eager, against a decode step: one
`ModelRunner` (no scheduler, no sampling), batch 1, a prompt of `--prompt-len` tokens cached.

For each k: the pass over the last token and k drafts (k + 1 positions) as decode rows replaying
the decode CUDA graph of the smallest captured size >= k + 1 (`speculative/rows.py`: what a
graphed verify pass runs), and as one eager EXTEND (`speculative_verify_mode="extend"`), beside the
one-row decode step (the same graph machinery at size 1). Times are per call, host work included
(metadata built on the device, static buffers filled, replay or eager launches), the device
synchronized around each call (median of `--iters`): a verify pass runs synchronously, so this is
its forward's share of the step. Random weights of a real architecture (default Llama-3-8B bf16).

    python bench/verify_forward.py --device cuda                      # Llama-3-8B, H100
    python bench/verify_forward.py --device cuda --dummy-config smollm2-135m
    python bench/verify_forward.py --device cpu --dummy-config smollm2-135m --ks 2 4 --iters 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402


def _timed_ms(fn: Callable[[], Any], device: Any, iters: int) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up
        fn()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dummy-config", default="llama-3-8b", choices=sorted(DUMMY_CONFIGS))
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--ks", type=int, nargs="*", default=[2, 4, 8, 12, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--out", default=str(RESULTS_DIR / "verify_forward.json"))
    args = parser.parse_args(argv)

    import random

    import torch

    from lmnb.runtime.config import EngineConfig
    from lmnb.runtime.core import Batch, ForwardMode
    from lmnb.runtime.memory import KVAllocator
    from lmnb.runtime.model_runner import ModelRunner
    from lmnb.runtime.models import loader
    from lmnb.runtime.models.layers.fusion import fused_kernels_available, set_fused_kernels

    device = resolve_device(args.device)
    widest = max(args.ks, default=1) + 1
    with tempfile.TemporaryDirectory() as scratch:
        dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
        config = loader.load_model_config(dummy.path)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            str(dummy.dtype), torch.float32) if device.type == "cuda" else torch.float32
        model = loader.load_model(dummy.path, config, dtype=dtype, device=device, dummy=True)
        if fused_kernels_available(device):
            set_fused_kernels(model, True)
        engine = EngineConfig(max_total_tokens=4 * (args.prompt_len + widest) + 64,
                              max_running_requests=4, attention_backend=args.attention_backend,
                              cuda_graph_max_bs=widest, speculative_algorithm="NGRAM",
                              speculative_num_draft_tokens=widest,
                              speculative_max_batch_size=1)
        runner = ModelRunner(model, config, engine, device=device, dtype=dtype,
                             eos_token_ids={config.vocab_size - 1})
        if runner.graph_max_bs:
            runner.capture_cuda_graphs(runner.graph_max_bs)
        graphs = runner.graph_runner
        rng = random.Random(0)
        allocator = KVAllocator(runner.max_total_tokens, device)
        pool = runner.req_to_token_pool
        req = pool.alloc()
        vocab = min(config.vocab_size, 32000)

        def batch(start: int, n: int) -> Batch:
            slots = allocator.alloc(n)
            pool.req_to_token[req, start:start + n] = slots
            return Batch(mode=ForwardMode.EXTEND, rids=[0], req_pool_indices=[req],
                         prefix_lens=[start], extend_lens=[n],
                         input_ids=[rng.randrange(100, vocab) for _ in range(n)],
                         out_cache_loc=slots, samples=[True], input_logprobs=[None],
                         mm_inputs=[None])

        prompt = batch(0, args.prompt_len)
        runner.position_logits(prompt, [args.prompt_len - 1], as_rows=False)
        start = args.prompt_len
        one = batch(start, 1)
        decode_ms = _timed_ms(lambda: runner.position_logits(one, as_rows=True), device,
                              args.iters)
        rows = []
        for k in args.ks:
            verify = batch(start, k + 1)
            graphed = _timed_ms(lambda v=verify: runner.position_logits(v, as_rows=True),
                                device, args.iters)
            eager = _timed_ms(lambda v=verify: runner.position_logits(v, as_rows=False),
                              device, args.iters)
            allocator.free(verify.out_cache_loc)
            rows.append({"k": k, "rows": k + 1,
                         "graph_size": graphs.bucket(k + 1) if graphs else None,
                         "graphed_ms": graphed, "eager_ms": eager,
                         "graphed_over_decode": graphed / decode_ms,
                         "eager_over_decode": eager / decode_ms})
        replays = graphs.replays if graphs else 0
        backend = runner.stats()["attention_backend"]
        runner.close()
    print(f"{dummy.label}, {backend} attention, decode step (1 row"
          f"{', graph replay' if graphs else ', eager'}): {decode_ms:.3f} ms")
    print(format_table(["k", "rows", "graph size", "graphed ms", "eager ms", "graphed/decode",
                        "eager/decode"],
                       [[r["k"], r["rows"], r["graph_size"], r["graphed_ms"], r["eager_ms"],
                         r["graphed_over_decode"], r["eager_over_decode"]] for r in rows]))
    path = write_json(args.out, {"benchmark": "verify_forward", "environment": environment(device),
                                 "model": dummy.label, "attention_backend": backend,
                                 "prompt_len": args.prompt_len, "iters": args.iters,
                                 "decode_ms": decode_ms, "graph_replays": replays,
                                 "verify": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
