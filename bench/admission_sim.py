"""How many requests decode together when the KV pool is the limit: the real scheduler's admission
over nano-vllm's offline workload, on the CPU, with a device-time model of each pass.

The offline workload on random Llama-2-7B fp16 (MHA: 512 KiB of KV a token) is KV-bound on an
80 GB H100: its ~114,000-token pool holds 41% of the 256 requests' 277,000 tokens, so what the
scheduler keeps back for running requests' future tokens (`schedule_conservativeness`, SGLang's
`new_token_ratio`; the exact peak of requests of known length, scheduler/kv_peak.py) and the
order it admits the waiting ones in (`--policy`) decide the decode batch. This runs
the real `Scheduler`, prefix cache and model runner over a null model (bench/scheduler_overhead.py:
no arithmetic; a pool of the GPU's size in tokens, each slot a few bytes) and records every
pass: mode, requests, new tokens, KV tokens read. No GPU is needed, and the passes are the ones
the engine would run on the GPU (the overlap schedule admits at the same points; `--overlap`
runs it).

Each pass is then priced by a roofline of the device (defaults: H100 80GB and Llama-2-7B, as
measured in bench/RESULTS.md): a decode pass reads the weights once or computes the batch's GEMMs,
whichever is longer, plus its requests' KV at the attention kernel's measured bandwidth; a
prefill pass computes its tokens' GEMMs. The model ranks policies; absolute seconds are
approximate. Reported per conservativeness: passes, mean decode batch, retractions and the
tokens they recompute, modelled device seconds and the ratio to the first value's.

    python bench/admission_sim.py                                   # 1.0, 0.5, 0.3, 0.0
    python bench/admission_sim.py --conservativeness 1,0.3 --pool-tokens 114000
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, write_json  # noqa: E402,I001
from bench.offline import make_workload  # noqa: E402
from bench.scheduler_overhead import NullModel, NullSink  # noqa: E402
from lmnb.runtime.config import EngineConfig, ModelConfig  # noqa: E402
from lmnb.runtime.core import Batch, ForwardMode, Req, SamplingParams  # noqa: E402
from lmnb.runtime.memory import KVAllocator  # noqa: E402
from lmnb.runtime.model_runner import ModelRunner  # noqa: E402
from lmnb.runtime.policy import make_policy  # noqa: E402
from lmnb.runtime.radix.cache import RadixCache  # noqa: E402
from lmnb.runtime.scheduler import (  # noqa: E402
    CacheManager,
    ReqState,
    Scheduler,
    SchedulerConfig,
    StopRules,
)

VOCAB = 2048  # the null model's; the workload's ids are folded into it


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Device time of a pass from its shape: weights (bytes), FLOPs a token, KV bytes a token."""

    weight_bytes: float = 13.48e9  # Llama-2-7B fp16
    flops_per_token: float = 2 * 6.74e9
    kv_bytes_per_token: float = 32 * 2 * 4096 * 2  # layers x (K, V) x hidden x fp16
    copy_bandwidth: float = 3.02e12  # H100 device-to-device copy, measured
    attention_bandwidth: float = 2.98e12  # the Triton decode kernel at batch 256 (session 7)
    gemm_flops: float = 660e12  # cuBLAS bf16 at prefill sizes, measured
    pass_overhead_s: float = 0.3e-3  # norms, rotary, sampling, launch tails

    def pass_s(self, new_tokens: int, kv_tokens: int) -> float:
        """A pass computing `new_tokens` (a decode pass: one a request) over `kv_tokens` of KV:
        the weights read once or the GEMMs' FLOPs, whichever is longer, plus the KV read."""
        gemm = max(self.weight_bytes / self.copy_bandwidth,
                   new_tokens * self.flops_per_token / self.gemm_flops)
        return gemm + kv_tokens * self.kv_bytes_per_token / self.attention_bandwidth \
            + self.pass_overhead_s


def tiny_config() -> ModelConfig:
    """A model config whose KV slot is 16 floats (K and V of one 8-wide head): a GPU-sized pool
    in a few MB."""
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", num_layers=1,
                       hidden_size=8, intermediate_size=16, num_heads=1, num_kv_heads=1,
                       head_dim=8, vocab_size=VOCAB, max_position_embeddings=4096)


def simulate(conservativeness: float, args: argparse.Namespace, roofline: Roofline
             ) -> dict[str, Any]:
    workload = make_workload(num_seqs=args.num_seqs, min_input_len=args.min_len,
                             max_input_len=args.max_len, min_output_len=args.min_len,
                             max_output_len=args.max_len, vocab_size=32_000)  # Llama-2's
    model_config = tiny_config()
    device = torch.device("cpu")
    engine_config = EngineConfig(max_total_tokens=args.pool_tokens,
                                 max_running_requests=args.max_running,
                                 context_length=2 * args.max_len + 8)
    model = NullModel(model_config.hidden_size, VOCAB, args.max_running, device)
    model.hidden = torch.zeros(args.chunk, model_config.hidden_size)
    runner = ModelRunner(model, model_config, engine_config, device=device,
                         dtype=torch.float32, eos_token_ids={2})
    allocator = KVAllocator(runner.max_total_tokens, device)
    config = SchedulerConfig(chunked_prefill_size=args.chunk, overlap_schedule=args.overlap)
    config.conservative(conservativeness)
    scheduler = Scheduler(
        runner=runner, cache=CacheManager(RadixCache(allocator), allocator,
                                          runner.req_to_token_pool),
        policy=make_policy(args.policy), config=config, stop_rules=StopRules({2}),
        sink=NullSink())
    passes: list[tuple[str, int, int, int]] = []  # mode, requests, new tokens, KV tokens read

    def record(batch: Batch) -> None:
        kv = sum(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens, strict=True))
        passes.append((batch.mode.value, len(batch.rids), sum(batch.extend_lens), kv))

    scheduler.batch_hook = record
    states = [ReqState(Req(origin_input_ids=[i % VOCAB for i in prompt],
                           sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                          ignore_eos=True)))
              for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)]
    started = time.perf_counter()
    for state in states:
        scheduler.add(state)
    while scheduler.step():
        pass
    host_s = time.perf_counter() - started
    assert all(len(s.req.output_ids) == s.req.sampling_params.max_new_tokens for s in states)
    decode = [p for p in passes if p[0] == ForwardMode.DECODE.value]
    extend = [p for p in passes if p[0] != ForwardMode.DECODE.value]
    decode_s = sum(roofline.pass_s(p[2], p[3]) for p in decode)
    extend_s = sum(roofline.pass_s(p[2], p[3]) for p in extend)
    prompt_tokens = sum(len(p) for p in workload.prompts)
    batches = [p[1] for p in decode]
    return {
        "conservativeness": conservativeness,
        "passes": len(passes), "decode_passes": len(decode), "extend_passes": len(extend),
        "mean_decode_batch": sum(batches) / max(len(batches), 1),
        "max_decode_batch": max(batches, default=0),
        "retractions": scheduler.stats.retractions,
        "prefilled_tokens": sum(p[2] for p in extend),
        "recomputed_tokens": sum(p[2] for p in extend) - prompt_tokens,
        "model_decode_s": decode_s, "model_extend_s": extend_s,
        "model_total_s": decode_s + extend_s, "host_s": host_s,
        "decode_batch_by_tenth": [round(sum(chunk) / len(chunk), 1) for chunk in
                                  (batches[i * len(batches) // 10:(i + 1) * len(batches) // 10]
                                   for i in range(10)) if chunk],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conservativeness", default="1,0.5,0.3,0",
                        help="schedule_conservativeness values, comma-separated")
    parser.add_argument("--pool-tokens", type=int, default=114_000,
                        help="KV pool in tokens (Llama-2-7B fp16 on an 80 GB H100: ~114,000)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size")
    parser.add_argument("--max-running", type=int, default=256,
                        help="max_running_requests (the CUDA-graph ladder's top)")
    parser.add_argument("--overlap", action="store_true", help="the overlap schedule")
    parser.add_argument("--policy", default="lpm", help="schedule_policy")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "admission_sim.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    roofline = Roofline()
    runs = [simulate(float(value), args, roofline) for value in args.conservativeness.split(",")]
    base = runs[0]["model_total_s"]
    header = (f"{'conserv.':>8} {'passes':>6} {'decode':>6} {'mean b':>7} {'max b':>5} "
              f"{'retract':>7} {'recomp.':>8} {'model s':>8} {'vs first':>8}")
    print(f"offline workload: {args.num_seqs} seqs, in/out {args.min_len}-{args.max_len}, "
          f"pool {args.pool_tokens:,} tokens, chunk {args.chunk}, "
          f"{'overlap' if args.overlap else 'sync'} schedule")
    print(header)
    for run in runs:
        print(f"{run['conservativeness']:>8.2f} {run['passes']:>6} {run['decode_passes']:>6} "
              f"{run['mean_decode_batch']:>7.1f} {run['max_decode_batch']:>5} "
              f"{run['retractions']:>7} {run['recomputed_tokens']:>8,} "
              f"{run['model_total_s']:>8.2f} {base / run['model_total_s']:>7.3f}x")
        print(f"{'':>8} decode batch by tenth of the run: {run['decode_batch_by_tenth']}")
    result = {"environment": environment(torch.device("cpu")), "args": vars(args),
              "roofline": dataclasses.asdict(roofline), "runs": runs}
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
