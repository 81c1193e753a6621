"""The hierarchical cache (issue 24): time to first token of a long prefix hit from host memory,
from disk and on the device against its recompute, and a multi-turn workload whose contexts add
up to 4x the GPU KV pool, with the host tier and without.

    python bench/hicache.py --dummy-config llama-3-8b --tokenizer .gpu/tokenizer   # H100
    python bench/hicache.py --dummy-config llama-3-8b --tokenizer .gpu/tokenizer --skip ttft
    python bench/hicache.py --smoke                                                # CPU check

TTFT: `generate` of prefix + a 32-token question with max_new_tokens=1 (wall clock, scheduling
included; 8,000 + 32 + 1 tokens fit Llama-3's 8,192 positions). Each repeat uses a prefix never
seen before: computed (recompute), then pushed out of the device pool by filler prompts (into the
host tier), then hit from the host, then hit on the device. Disk: a first Runtime computes other
prefixes (writing their pages), is closed, and a second Runtime on the same model and directory
hits them (the files are in the OS page cache).

Multi-turn: conversations x turns; each turn adds user tokens to the conversation's context and
generates an answer; a round sends every conversation's next turn as one batch, so a context
comes back after all the others went through the pool. Throughput: (prompt + generated tokens)
per second of the whole workload. With the host tier it also reports how long the host -> device
copies took (`hicache_load_seconds`: first copy to last, CUDA events) and how much of that the
forward stood waiting for them (`hicache_load_wait_seconds`: per layer, from the compute stream's
arrival at the layer's wait to the layer's copies' end); the rest was overlapped with compute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    stopwatch,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from lmnb.runtime.hicache.disk import PAGE_TOKENS  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    prefix: int  # TTFT prefix tokens
    repeats: int
    pool: int  # multi-turn: GPU KV pool tokens
    conversations: int
    turns: int
    turn_tokens: int  # user tokens added per turn
    answer: int  # generated tokens per turn
    chunk: int | None  # chunked_prefill_size (None: the device's default)


FULL = Sizes(prefix=8000, repeats=3, pool=16384, conversations=16, turns=4, turn_tokens=1024,
             answer=32, chunk=None)
SMOKE = Sizes(prefix=512, repeats=2, pool=512, conversations=8, turns=4, turn_tokens=60,
              answer=4, chunk=256)
TTFT_HOST_RATIO = 2.0  # the TTFT runs' host tier: room for the prefix and the filler
QUESTION = 32


class Tokens:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, self.vocab - 1) for _ in range(n)]


def ttft(rt: Any, ids: list[int], device: Any) -> float:
    with stopwatch(device) as t:
        rt.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return t["seconds"]


def push_out(rt: Any, tokens: Tokens, pool: int) -> None:
    """Prompts never seen before, one after the other, adding up to the whole pool: what was
    cached before them (the oldest) leaves the device pool."""
    longest = rt.context_len - 64
    count = -(-pool // longest)
    for _ in range(count):
        rt.generate(input_ids=tokens(pool // count), sampling_params={"max_new_tokens": 1})


def wait_for_pages(rt: Any, pages: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while rt.stats()["hicache_disk_written_pages"] < pages and time.monotonic() < deadline:
        time.sleep(0.05)


def measure_ttft(model_dir: Path, options: dict[str, Any], sizes: Sizes, tokens: Tokens,
                 storage: Path) -> dict[str, Any]:
    import lmnb

    prefix = sizes.prefix
    pool = prefix * 5 // 2
    device = options["device"]
    times: dict[str, list[float]] = {"recompute": [], "host": [], "device": [], "disk": []}
    loaded_host = []
    with lmnb.Runtime(model_dir, max_total_tokens=pool, enable_hierarchical_cache=True,
                      hicache_ratio=TTFT_HOST_RATIO, **options) as rt:
        ttft(rt, tokens(QUESTION), device)  # warm-up
        for _ in range(sizes.repeats):
            context = tokens(prefix)
            times["recompute"].append(ttft(rt, context + tokens(QUESTION), device))
            push_out(rt, tokens, pool)
            before = rt.stats()["hicache_host_loaded_tokens"]
            times["host"].append(ttft(rt, context + tokens(QUESTION), device))
            loaded_host.append(rt.stats()["hicache_host_loaded_tokens"] - before)
            times["device"].append(ttft(rt, context + tokens(QUESTION), device))
    disk_options = dict(options, max_total_tokens=pool, enable_hierarchical_cache=True,
                        hicache_ratio=TTFT_HOST_RATIO, hicache_storage_backend="file",
                        hicache_storage_dir=str(storage))
    contexts = [tokens(prefix) for _ in range(sizes.repeats)]
    with lmnb.Runtime(model_dir, **disk_options) as rt:
        for done, context in enumerate(contexts, start=1):
            rt.generate(input_ids=context + tokens(QUESTION), sampling_params={"max_new_tokens": 1})
            wait_for_pages(rt, done * (prefix // PAGE_TOKENS))  # none dropped for a slow disk
    with lmnb.Runtime(model_dir, **disk_options) as rt:
        ttft(rt, tokens(QUESTION), device)
        for context in contexts:
            times["disk"].append(ttft(rt, context + tokens(QUESTION), device))
        loaded_disk = rt.stats()["hicache_disk_loaded_tokens"]
    median = {name: statistics.median(values) for name, values in times.items()}
    return {"prefix_tokens": prefix, "pool_tokens": pool, "seconds": times,
            "median_seconds": median,
            "host_over_recompute": median["host"] / median["recompute"],
            "disk_over_recompute": median["disk"] / median["recompute"],
            "device_over_recompute": median["device"] / median["recompute"],
            "host_loaded_tokens": loaded_host, "disk_loaded_tokens": loaded_disk}


def multi_turn(model_dir: Path, options: dict[str, Any], sizes: Sizes, *, hicache: bool,
               host_ratio: float, device: Any, vocab: int) -> dict[str, Any]:
    import lmnb

    tokens = Tokens(vocab, seed=1)
    contexts = [tokens(sizes.turn_tokens) for _ in range(sizes.conversations)]
    params = {"max_new_tokens": sizes.answer, "temperature": 0, "ignore_eos": True}
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=host_ratio) if hicache else {}
    total = cached = 0
    with lmnb.Runtime(model_dir, max_total_tokens=sizes.pool, **extra, **options) as rt:
        rt.generate(input_ids=tokens(QUESTION), sampling_params={"max_new_tokens": 1})
        with stopwatch(device) as t:
            for turn in range(sizes.turns):
                results = rt.generate(input_ids=contexts, sampling_params=params)
                for i, result in enumerate(results):
                    total += len(contexts[i]) + len(result["output_ids"])
                    cached += result["meta_info"]["cached_tokens"]
                    if turn + 1 < sizes.turns:
                        contexts[i] = contexts[i] + result["output_ids"] + tokens(
                            sizes.turn_tokens)
        stats = rt.stats()
    load = stats.get("hicache_load_seconds", 0.0)
    waited = stats.get("hicache_load_wait_seconds", 0.0)
    return {"seconds": t["seconds"], "tokens": total, "tokens_per_second": total / t["seconds"],
            "cached_tokens": cached,
            "host_loaded_tokens": stats.get("hicache_host_loaded_tokens", 0),
            "final_context_tokens": sum(map(len, contexts)),
            "forward_passes": stats["forward_passes"], "retractions": stats["retractions"],
            "evicted_tokens": stats["evicted_tokens"],
            # passes that loaded, the copies' span, the part of it the forward waited for
            "load_passes": stats.get("hicache_loads", 0), "load_seconds": load,
            "load_wait_seconds": waited,
            "load_overlapped_share": 1.0 - waited / load if load > 0 else None,
            "save_fence_waits": stats.get("hicache_save_fence_waits", 0),
            "host_saved_tokens": stats.get("hicache_host_saved_tokens", 0)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default="llama-3-8b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random Llama-3-shaped model, small sizes (CPU)")
    parser.add_argument("--host-ratio", type=float, default=5.0,
                        help="multi-turn: host tier tokens per GPU pool token (hicache_ratio)")
    parser.add_argument("--skip", default="", help="comma list of: ttft, multi-turn")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "hicache.json")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    device = resolve_device(args.device if not args.smoke else "cpu")
    name = "tiny-llama-3" if args.smoke else args.dummy_config
    options: dict[str, Any] = {"device": str(device)}
    if sizes.chunk:
        options["chunked_prefill_size"] = sizes.chunk
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"environment": environment(device), "model": name,
                              "sizes": asdict(sizes), "host_ratio": args.host_ratio}
    with tempfile.TemporaryDirectory() as scratch:
        dummy = write_dummy_model(name, scratch, args.tokenizer)
        options.update(dummy.runtime_options())
        vocab = min(dummy.fields["vocab_size"], 32000)  # ids every tokenizer here decodes
        if "ttft" not in skip:
            report["ttft"] = measure_ttft(dummy.path, options, sizes, Tokens(vocab),
                                          Path(scratch) / "kv")
            m = report["ttft"]["median_seconds"]
            print(f"\nTTFT of a {sizes.prefix}-token prefix (median of {sizes.repeats}):")
            print(format_table(["source", "seconds", "x recompute"], [
                [source, m[source], m[source] / m["recompute"]]
                for source in ("recompute", "host", "disk", "device")]))
            print(f"host hit <= 0.3x recompute: {report['ttft']['host_over_recompute'] <= 0.3}")
        if "multi-turn" not in skip:
            off = multi_turn(dummy.path, options, sizes, hicache=False,
                             host_ratio=args.host_ratio, device=device, vocab=vocab)
            on = multi_turn(dummy.path, options, sizes, hicache=True,
                            host_ratio=args.host_ratio, device=device, vocab=vocab)
            ratio = on["tokens_per_second"] / off["tokens_per_second"]
            report["multi_turn"] = {"without_host_tier": off, "with_host_tier": on,
                                    "speedup": ratio,
                                    "contexts_over_pool": on["final_context_tokens"] / sizes.pool}
            print(f"\nmulti-turn: {sizes.conversations} conversations x {sizes.turns} turns, "
                  f"contexts {on['final_context_tokens']:,} tokens = "
                  f"{report['multi_turn']['contexts_over_pool']:.1f}x the {sizes.pool:,}-token "
                  f"pool")
            print(format_table(["host tier", "seconds", "tokens/s", "cached tokens"], [
                ["off", off["seconds"], off["tokens_per_second"], off["cached_tokens"]],
                ["on", on["seconds"], on["tokens_per_second"], on["cached_tokens"]]]))
            print(f"speedup {ratio:.2f}x (target >= 1.5x: {ratio >= 1.5})")
            share = on["load_overlapped_share"]
            print(f"host tier: {on['host_loaded_tokens']:,} tokens loaded in "
                  f"{on['load_passes']} passes; copies {on['load_seconds']:.3f} s, the forward "
                  f"waited {on['load_wait_seconds']:.3f} s of it (overlapped: "
                  f"{'-' if share is None else f'{share:.0%}'}); {on['host_saved_tokens']:,} "
                  f"tokens saved, {on['save_fence_waits']} evictions waited for a save; passes "
                  f"{off['forward_passes']} off / {on['forward_passes']} on, retractions "
                  f"{off['retractions']} / {on['retractions']}")
    path = write_json(args.output, report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
