"""The scheduler's own time per decode step, and batch-1 decode beside the HBM floor.

Part 1 (every device): the real scheduler, model runner (ForwardBatch, attention metadata,
SamplingBatchInfo, sampler) and output processor (a started thread detokenizing into streams)
run decode steps over a *null model* whose forward returns preallocated hidden states and
fixed logits. What is left of a step is the engine's own work: admission, batch and metadata
building, sampling preparation and sampling, output processing. The sampler's time is shown
apart (on a GPU its kernels are queued, the step waits once for the sampled ids).

Part 2 (`--model-config NAME`, meant for the GPU): batch-1 decode of the whole runtime on random
weights of a real architecture, beside the HBM floor measured in the same run: weight bytes /
device-to-device copy bandwidth.

    python bench/scheduler_overhead.py                         # CPU, part 1 only
    python bench/scheduler_overhead.py --device cuda --model-config llama-2-7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, resolve_device, write_json  # noqa: E402,I001
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402
from bench.floor import copy_bandwidth  # noqa: E402
from lmnb.runtime.config import EngineConfig, ModelConfig  # noqa: E402
from lmnb.runtime.core import Req, SamplingParams  # noqa: E402
from lmnb.runtime.memory import KVAllocator  # noqa: E402
from lmnb.runtime.model_runner import ModelRunner  # noqa: E402
from lmnb.runtime.models import loader  # noqa: E402
from lmnb.runtime.output import OutputProcessor, OutputStream  # noqa: E402
from lmnb.runtime.policy import make_policy  # noqa: E402
from lmnb.runtime.radix.cache import RadixCache  # noqa: E402
from lmnb.runtime.speculative.factory import make_speculator  # noqa: E402
from lmnb.runtime.scheduler import (  # noqa: E402
    CacheManager,
    ReqState,
    Scheduler,
    SchedulerConfig,
    StopRules,
)

PROMPT_LEN = 256


class NullSink:
    """A scheduler's output sink that drops every event (no output thread)."""

    def put(self, events: list[Any]) -> None:
        pass


class NullModel(torch.nn.Module):
    """The model's interface at no cost: preallocated hidden states and logits. Logits favour a
    different ordinary token per row, so outputs are real text ids that change per row."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int,
                 device: torch.device) -> None:
        super().__init__()
        self.hidden = torch.zeros(8192, hidden_size, device=device)
        logits = torch.randn(max_rows, vocab_size, device=device)
        logits[torch.arange(max_rows), 1000 + torch.arange(max_rows)] += 100.0
        self.logits = logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: Any) -> torch.Tensor:
        return self.hidden[:len(input_ids)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:len(hidden)]


class TimedSampler:
    """Wraps the runner's sampler to add up its time (sampling is part of the engine's work,
    shown apart)."""

    def __init__(self, sampler: Any) -> None:
        self.inner = sampler
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def scheduler_step_times(model_config: ModelConfig, tokenizer: Any, device: torch.device,
                         batch_size: int, steps: int, *, temperature: float = 0.0,
                         overlap: bool = False, speculative: str | None = None
                         ) -> dict[str, float]:
    """Median milliseconds per decode step at `batch_size` (after warm-up), of which sampling;
    the scheduler thread's CPU time per step and the output thread's (its mean busy time per
    step it handled: detokenizing and delivering, competing for the GIL). `speculative`: the
    scheduler gets that algorithm's speculator (NGRAM; it drafts only at batches up to
    `speculative_max_batch_size`, and the null model's rows repeat one token each, so its
    drafts are always accepted)."""
    max_tokens = batch_size * (PROMPT_LEN + steps + 16) + 64
    engine_config = EngineConfig(max_total_tokens=max_tokens, max_running_requests=batch_size,
                                 context_length=PROMPT_LEN + steps + 32,
                                 speculative_algorithm=speculative)
    model = NullModel(model_config.hidden_size, model_config.vocab_size, batch_size, device)
    runner = ModelRunner(model, model_config, engine_config, device=device, dtype=torch.float16
                         if device.type == "cuda" else torch.float32, eos_token_ids={2})
    sampler = TimedSampler(runner.sampler)
    runner.sampler = sampler
    allocator = KVAllocator(runner.max_total_tokens, device)
    spec = engine_config.speculative()
    speculator = (make_speculator(spec, engine_config=engine_config, target=runner,
                                  eos_token_ids={2}) if spec is not None else None)
    outputs = OutputProcessor()
    outputs.start()
    scheduler = Scheduler(
        runner=runner, cache=CacheManager(RadixCache(allocator), allocator,
                                          runner.req_to_token_pool),
        policy=make_policy("lpm"), config=SchedulerConfig(chunked_prefill_size=8192,
                                                          overlap_schedule=overlap),
        stop_rules=StopRules({2}), sink=outputs, tokenizer=tokenizer, speculator=speculator,
        verifier=runner if speculator is not None else None)
    states = [ReqState(Req(origin_input_ids=[(7 * i + j) % 30000 + 100 for j in range(PROMPT_LEN)],
                           sampling_params=SamplingParams(max_new_tokens=steps + 8,
                                                          temperature=temperature,
                                                          ignore_eos=True)))
              for i in range(batch_size)]
    stream = OutputStream([s.rid for s in states], incremental=True)
    for state in states:
        outputs.register(stream, state.rid, tokenizer=tokenizer, prompt_ids=state.origin_input_ids)
        scheduler.add(state)
    while scheduler.table.waiting:  # prefill
        scheduler.step()
    times, sampling, cpu = [], [], []
    overlapped = scheduler.stats.overlapped_passes
    for _ in range(steps):
        before = sampler.seconds
        start, start_cpu = time.perf_counter(), time.thread_time()
        scheduler.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        sampling.append(sampler.seconds - before)
    assert len(scheduler.table.running) == batch_size, "every request must still decode"
    stream.close()
    outputs.close()
    skip = min(5, steps // 4)  # warm-up
    return {"step_ms": 1e3 * statistics.median(times[skip:]),
            "sampling_ms": 1e3 * statistics.median(sampling[skip:]),
            "rest_ms": 1e3 * statistics.median(t - s for t, s in zip(times[skip:], sampling[skip:],
                                                                      strict=True)),
            "scheduler_cpu_ms": 1e3 * statistics.median(cpu[skip:]),
            "output_thread_ms": 1e3 * outputs.busy_seconds / max(outputs.batches_handled, 1),
            "overlapped_steps": scheduler.stats.overlapped_passes - overlapped}


DECODE_MODES: dict[str, dict[str, Any]] = {  # label -> Runtime options
    "eager, torch-native": {"attention_backend": "torch_native", "disable_cuda_graph": True},
    "graphs, torch-native": {"attention_backend": "torch_native", "cuda_graph_max_bs": 1},
    "graphs, triton": {"attention_backend": "triton"},
    "auto (best backend, graphs)": {},
}


def batch1_decode(config_name: str, tokenizer_dir: Path | None, device: torch.device,
                  new_tokens: int, options: dict[str, Any]) -> dict[str, Any]:
    from lmnb.runtime.engine import Runtime

    fields = DUMMY_CONFIGS[config_name]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / config_name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(fields))
        tokenizer = str(tokenizer_dir) if tokenizer_dir else str(loader.resolve_model_dir(None))
        with Runtime(str(folder), tokenizer_path=tokenizer, load_format="dummy",
                     device=str(device), dtype=fields["dtype"], context_length=2048,
                     max_running_requests=4, **options) as rt:
            backend = rt.stats()["attention_backend"]
            weight_bytes = rt.weight_bytes
            prompt = list(range(100, 100 + PROMPT_LEN))
            params = {"temperature": 0, "ignore_eos": True}

            def run(tokens: int) -> float:
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                rt.generate(input_ids=prompt, sampling_params={**params,
                                                               "max_new_tokens": tokens})
                return time.perf_counter() - start

            run(4)
            short = min(run(2) for _ in range(3))
            long = min(run(new_tokens + 2) for _ in range(2))
            step = (long - short) / new_tokens
    bandwidth = copy_bandwidth(device)
    floor = weight_bytes / bandwidth
    return {"attention_backend": backend, "weight_gb": weight_bytes / 1e9,
            "copy_tb_s": bandwidth / 1e12,
            "hbm_floor_ms": 1e3 * floor, "decode_step_ms": 1e3 * step,
            "fraction_of_floor": floor / step}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,16,64,128")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="shapes of the null model (default: the embedded SmolLM2's)")
    parser.add_argument("--model-config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="also time batch-1 decode of random weights of this architecture")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="of every request (the offline workload samples at 0.6)")
    parser.add_argument("--overlap", action="store_true",
                        help="overlap schedule (the default on CUDA): launch step N+1, then "
                        "process step N")
    parser.add_argument("--speculative", default=None, choices=["NGRAM"],
                        help="configure this speculative algorithm (inactive above "
                        "speculative_max_batch_size 8: what it costs a large batch)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the tokenizer files (default: the embedded SmolLM2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    tokenizer_dir = args.tokenizer or loader.resolve_model_dir(None)
    tokenizer = loader.load_tokenizer(tokenizer_dir)
    if args.config:
        from transformers import AutoConfig

        fields = dict(DUMMY_CONFIGS[args.config])
        model_config = ModelConfig.from_hf(
            AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict())
    else:
        model_config = loader.load_model_config(tokenizer_dir)
    rows = []
    per_batch = {}
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        result = scheduler_step_times(model_config, tokenizer, device, batch_size, args.steps,
                                      temperature=args.temperature, overlap=args.overlap,
                                      speculative=args.speculative)
        per_batch[batch_size] = result
        rows.append([batch_size, f"{result['step_ms']:.3f}", f"{result['sampling_ms']:.3f}",
                     f"{result['rest_ms']:.3f}",
                     f"{result['scheduler_cpu_ms']:.3f}", f"{result['output_thread_ms']:.3f}"])
    print(f"scheduler overhead per decode step (null model, vocab {model_config.vocab_size}, "
          f"prompt {PROMPT_LEN}, temperature {args.temperature}, "
          f"overlap {'on' if args.overlap else 'off'}, speculative {args.speculative}) "
          f"on {device}")
    print(format_table(["batch", "step ms", "of which sampling ms", "rest ms (per-step median)",
                        "scheduler thread CPU ms", "output thread ms"], rows))
    results: dict[str, Any] = {"environment": environment(device), "args": vars(args) | {
        "tokenizer": str(args.tokenizer) if args.tokenizer else None},
        "scheduler_overhead": per_batch}
    if 64 in per_batch:
        print(f"batch 64: {per_batch[64]['step_ms']:.3f} ms per step "
              f"(target <= 2 ms): {'met' if per_batch[64]['step_ms'] <= 2.0 else 'missed'}")
    if args.model_config:
        if device.type != "cuda":
            raise SystemExit("--model-config needs a CUDA device (the floor is HBM bandwidth)")
        results["batch1_decode"] = {"model": args.model_config}
        for mode, options in DECODE_MODES.items():
            decode = batch1_decode(args.model_config, args.tokenizer, device,
                                   args.decode_tokens, options)
            results["batch1_decode"][mode] = decode
            print(f"batch-1 decode ({mode}: {decode['attention_backend']}), random "
                  f"{args.model_config}: "
                  f"{decode['decode_step_ms']:.2f} ms per step; HBM floor "
                  f"{decode['hbm_floor_ms']:.2f} ms ({decode['weight_gb']:.2f} GB at "
                  f"{decode['copy_tb_s']:.2f} TB/s): {100 * decode['fraction_of_floor']:.1f}% "
                  "of the floor")
    write_json(RESULTS_DIR / f"scheduler_overhead_{device.type}.json", results)
    return results


if __name__ == "__main__":
    main()
