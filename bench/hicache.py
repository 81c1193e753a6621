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

Multi-turn: SGLang's `benchmark/hicache/bench_multiturn.py` (`Workload`): clients, each round a
new user turn appended to its conversation, at most `max_parallel` requests in flight, the next
one a random client whose previous answer came back; the conversations add up to 4x the GPU KV
pool. Shapes (`WORKLOADS`; `--workloads`, by default the first three): SGLang's defaults (5
rounds of 512-token turns), long-context (a 4,096-token first request, then short questions),
the same prefill-only (1-token answers, as SGLang's HiCache blog runs it) and long chats (10
rounds). Each runs without and with the host tier; throughput is (prompt +
generated tokens) per second of the whole workload (requests/s, SGLang's, in the same ratio),
with TTFT (send to first streamed token) and the prompt tokens hit on the device, loaded from
the host and prefilled, overall and by round. Per kind of forward pass (prefill / decode):
passes, seconds (gaps between passes' ends), mean batch. With the host tier: the host -> device
copies' span (`hicache_load_seconds`, CUDA events) and how much of it the forward stood waiting
(`hicache_load_wait_seconds`, per layer); the rest overlapped.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
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
from lmnb.runtime.core import Batch, ForwardMode  # noqa: E402
from lmnb.runtime.hicache.disk import PAGE_TOKENS  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    prefix: int  # TTFT prefix tokens
    repeats: int
    chunk: int | None  # chunked_prefill_size (None: the device's default)


FULL = Sizes(prefix=8000, repeats=3, chunk=None)
SMOKE = Sizes(prefix=512, repeats=2, chunk=256)
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


@dataclass(frozen=True)
class Workload:
    """SGLang's `benchmark/hicache/bench_multiturn.py`: `clients` conversations; a client's first
    request is `request_length` new tokens, each later one its conversation so far plus a new
    user turn of `sub_question_length` tokens (SGLang's `--sub-question-input-length`, 0: the
    request length); each generates `output_length` tokens, which join the conversation. At most
    `max_parallel` requests are in flight; a client whose answer came back queues its next turn,
    and the next request sent is a random queued one (its `--ready-queue-policy random`), as
    soon as one completes (its request rate at infinity). SGLang's defaults: 256 clients, 128 in
    flight, 512 + 64 tokens, 5 rounds; here fewer clients, so that the host tier holds every
    conversation (4x the pool) in pinned host memory."""

    clients: int
    rounds: int
    request_length: int
    output_length: int
    max_parallel: int
    sub_question_length: int = 0
    over_pool: float = 4.0  # the conversations' final lengths over the GPU KV pool

    @property
    def turn_length(self) -> int:
        """New user tokens of rounds after the first."""
        return self.sub_question_length or self.request_length

    @property
    def conversation_tokens(self) -> int:
        return (self.request_length + (self.rounds - 1) * self.turn_length
                + self.rounds * self.output_length)

    @property
    def pool(self) -> int:
        return int(self.clients * self.conversation_tokens / self.over_pool)


# Each: conversations 4x a GPU pool of ~45k tokens (~6 GB of Llama-3-8B KV; the host tier, 5x,
# ~30 GB pinned). "sglang": SGLang's defaults (5 rounds of 512 + 64 tokens, in flight = clients
# / 2) at 64 clients. "long-context": a 4,096-token first request (a document, a code base)
# then 4 follow-up questions of 256 tokens (SGLang's --sub-question-input-length), 64-token
# answers, 32 clients: the context is long from the first round on. "long-context-prefill": the
# same with 1-token answers, as SGLang's HiCache blog runs bench_multiturn (`--output-length 1`,
# a prefill server of a prefill/decode split). "long-chat": SGLang's turns for 10 rounds (5,760-
# token conversations) at 32 clients.
WORKLOADS = {
    "sglang": Workload(clients=64, rounds=5, request_length=512, output_length=64,
                       max_parallel=32),
    "long-context": Workload(clients=32, rounds=5, request_length=4096, output_length=64,
                             max_parallel=16, sub_question_length=256),
    "long-context-prefill": Workload(clients=32, rounds=5, request_length=4096, output_length=1,
                                     max_parallel=16, sub_question_length=256),
    "long-chat": Workload(clients=32, rounds=10, request_length=512, output_length=64,
                          max_parallel=16),
}
DEFAULT_WORKLOADS = "sglang,long-context,long-context-prefill"
SMOKE_WORKLOADS = {
    "sglang": Workload(clients=8, rounds=3, request_length=48, output_length=4, max_parallel=4),
    "long-context": Workload(clients=4, rounds=3, request_length=128, output_length=4,
                             max_parallel=2, sub_question_length=16),
    "long-context-prefill": Workload(clients=4, rounds=3, request_length=128, output_length=1,
                                     max_parallel=2, sub_question_length=16),
    "long-chat": Workload(clients=4, rounds=6, request_length=48, output_length=4,
                          max_parallel=2),
}


@dataclass(slots=True)
class Turn:
    client: int
    round: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float  # seconds from the request's send to its first token
    latency: float


class Passes:
    """`Runtime.set_batch_hook`: each forward pass's end, kind and size; a pass's time is the
    gap since the previous pass ended (passes run back to back while requests are queued)."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, bool, int, int]] = []  # (end, extend, requests, new tokens)

    def __call__(self, batch: Batch) -> None:
        self.ends.append((time.perf_counter(), batch.mode is ForwardMode.EXTEND, batch.size,
                          sum(batch.extend_lens)))

    def summary(self, start: float) -> dict[str, Any]:
        out = {kind: {"passes": 0, "seconds": 0.0, "requests": 0, "tokens": 0}
               for kind in ("prefill", "decode")}
        previous = start
        for end, extend, requests, tokens in self.ends:
            row = out["prefill" if extend else "decode"]
            row["passes"] += 1
            row["seconds"] += end - previous
            row["requests"] += requests
            row["tokens"] += tokens
            previous = end
        for row in out.values():
            row["mean_batch"] = row["requests"] / max(row["passes"], 1)
            row["ms_per_pass"] = 1e3 * row["seconds"] / max(row["passes"], 1)
        return out


async def drive(rt: Any, workload: Workload, tokens: Tokens, seed: int) -> list[Turn]:
    """Runs the workload to its end; one `Turn` per request, in completion order."""
    rng = random.Random(seed)
    params = {"max_new_tokens": workload.output_length, "temperature": 0, "ignore_eos": True}
    history = [tokens(workload.request_length) for _ in range(workload.clients)]
    rounds = [0] * workload.clients
    ready = list(range(workload.clients))
    turns: list[Turn] = []

    async def one(client: int) -> None:
        ids = history[client]
        sent = time.perf_counter()
        first = None
        output: list[int] = []
        meta: dict[str, Any] = {}
        async for chunk in rt.generate(input_ids=ids, sampling_params=params, stream=True):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter()
            output += chunk["output_ids"]
            meta = chunk["meta_info"]
        done = time.perf_counter()
        turns.append(Turn(client, rounds[client], len(ids), meta["cached_tokens"], len(output),
                          (first or done) - sent, done - sent))
        rounds[client] += 1
        if rounds[client] < workload.rounds:
            history[client] = ids + output + tokens(workload.turn_length)
            ready.append(client)

    in_flight: set[asyncio.Task[None]] = set()
    while ready or in_flight:
        while ready and len(in_flight) < workload.max_parallel:
            client = ready.pop(rng.randrange(len(ready)))
            in_flight.add(asyncio.ensure_future(one(client)))
        finished, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            task.result()  # a failed request fails the run
    return turns


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def per_round(turns: list[Turn]) -> list[dict[str, float]]:
    """Each round's prompt tokens, share of them hit in the cache, and mean TTFT."""
    rounds: dict[int, list[Turn]] = {}
    for turn in turns:
        rounds.setdefault(turn.round, []).append(turn)
    out = []
    for number in sorted(rounds):
        group = rounds[number]
        prompt = sum(t.prompt_tokens for t in group)
        out.append({"round": number, "prompt_tokens": prompt,
                    "hit_share": sum(t.cached_tokens for t in group) / prompt,
                    "ttft_mean": statistics.fmean(t.ttft for t in group)})
    return out


def multi_turn(model_dir: Path, options: dict[str, Any], workload: Workload, *, hicache: bool,
               host_ratio: float, vocab: int) -> dict[str, Any]:
    import lmnb

    extra = dict(enable_hierarchical_cache=True, hicache_ratio=host_ratio) if hicache else {}
    with lmnb.Runtime(model_dir, max_total_tokens=workload.pool, **extra, **options) as rt:
        rt.generate(input_ids=Tokens(vocab, seed=99)(QUESTION),
                    sampling_params={"max_new_tokens": 1})
        passes = Passes()
        rt.set_batch_hook(passes)
        before = rt.stats()
        start = time.perf_counter()
        turns = asyncio.run(drive(rt, workload, Tokens(vocab, seed=1), seed=1))
        seconds = time.perf_counter() - start
        rt.set_batch_hook(None)
        stats = rt.stats()
    prompt = sum(t.prompt_tokens for t in turns)
    generated = sum(t.output_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    host = stats.get("hicache_host_loaded_tokens", 0) - before.get("hicache_host_loaded_tokens", 0)
    load = stats.get("hicache_load_seconds", 0.0)
    waited = stats.get("hicache_load_wait_seconds", 0.0)
    ttfts = [t.ttft for t in turns]
    return {"seconds": seconds, "requests": len(turns),
            "requests_per_second": len(turns) / seconds,
            "tokens_per_second": (prompt + generated) / seconds,
            "prompt_tokens": prompt, "generated_tokens": generated,
            "cached_tokens": cached, "computed_prompt_tokens": prompt - cached,
            # hits by tier: loaded from the host pool (only admitted requests load), else found
            # on the device
            "hit_tokens": {"device": cached - min(host, cached), "host": host},
            "ttft_mean": statistics.fmean(ttfts), "ttft_median": statistics.median(ttfts),
            "ttft_p90": percentile(ttfts, 0.9),
            "latency_mean": statistics.fmean(t.latency for t in turns),
            "per_round": per_round(turns),
            "passes": passes.summary(start),
            "forward_passes": stats["forward_passes"] - before["forward_passes"],
            "retractions": stats["retractions"] - before["retractions"],
            "evicted_tokens": stats["evicted_tokens"] - before["evicted_tokens"],
            # passes that loaded, the copies' span, the part of it the forward waited for
            "load_passes": stats.get("hicache_loads", 0), "load_seconds": load,
            "load_wait_seconds": waited,
            "load_overlapped_share": 1.0 - waited / load if load > 0 else None,
            "save_fence_waits": stats.get("hicache_save_fence_waits", 0),
            "host_saved_tokens": stats.get("hicache_host_saved_tokens", 0),
            "host_evicted_tokens": stats.get("hicache_host_evicted_tokens", 0)}


def report_multi_turn(label: str, workload: Workload, off: dict[str, Any],
                      on: dict[str, Any]) -> float:
    ratio = on["tokens_per_second"] / off["tokens_per_second"]
    turns = (f"{workload.request_length}" if workload.turn_length == workload.request_length
             else f"{workload.request_length} then {workload.turn_length}")
    print(f"\nmulti-turn {label!r} (SGLang bench_multiturn shape): {workload.clients} clients x "
          f"{workload.rounds} rounds of {turns} + {workload.output_length} tokens, "
          f"{workload.max_parallel} in flight; conversations "
          f"{workload.clients * workload.conversation_tokens:,} tokens = "
          f"{workload.over_pool:g}x the {workload.pool:,}-token pool")
    rows = []
    for name, run in (("off", off), ("on", on)):
        rows.append([name, run["seconds"], run["tokens_per_second"], run["requests_per_second"],
                     run["ttft_mean"], run["ttft_p90"], run["computed_prompt_tokens"],
                     run["hit_tokens"]["device"], run["hit_tokens"]["host"]])
    print(format_table(["host tier", "seconds", "tokens/s", "req/s", "TTFT mean", "TTFT p90",
                        "prefilled", "hit device", "hit host"], rows))
    print(f"speedup {ratio:.2f}x (target >= 1.5x: {ratio >= 1.5})")
    for name, run in (("off", off), ("on", on)):
        parts = ", ".join(f"{kind} {row['passes']} passes {row['seconds']:.2f} s "
                          f"({row['ms_per_pass']:.1f} ms, batch {row['mean_batch']:.1f}, "
                          f"{row['tokens']:,} tokens)" for kind, row in run["passes"].items())
        print(f"  {name}: {parts}; retractions {run['retractions']}")
        print(f"  {name}: hit share / TTFT by round: " + ", ".join(
            f"{row['hit_share']:.0%} / {row['ttft_mean']:.2f} s" for row in run["per_round"]))
    share = on["load_overlapped_share"]
    print(f"host tier: {on['hit_tokens']['host']:,} tokens loaded in {on['load_passes']} passes; "
          f"copies {on['load_seconds']:.3f} s, the forward waited {on['load_wait_seconds']:.3f} s "
          f"of it (overlapped: {'-' if share is None else f'{share:.0%}'}); "
          f"{on['host_saved_tokens']:,} tokens saved, {on['host_evicted_tokens']:,} dropped from "
          f"the host pool, {on['save_fence_waits']} evictions waited for a save")
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default="llama-3-8b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random Llama-3-shaped model, small sizes (CPU)")
    parser.add_argument("--host-ratio", type=float, default=5.0,
                        help="multi-turn: host tier tokens per GPU pool token (hicache_ratio)")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                        help=f"multi-turn: comma list of {', '.join(WORKLOADS)}")
    for field_name in ("clients", "rounds", "request_length", "output_length", "max_parallel",
                       "sub_question_length"):
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=int, default=None,
                            help="multi-turn: overrides the workloads' value")
    parser.add_argument("--over-pool", type=float, default=None,
                        help="the conversations' final lengths over the GPU KV pool")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="prompt tokens per prefill pass (default: 8192 on CUDA; smoke 256)")
    parser.add_argument("--skip", default="", help="comma list of: ttft, multi-turn")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "hicache.json")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    overrides = {name: getattr(args, name) for name in (
        "clients", "rounds", "request_length", "output_length", "max_parallel",
        "sub_question_length", "over_pool")
        if getattr(args, name) is not None}
    table = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    workloads = {name: replace(table[name], **overrides)
                 for name in filter(None, args.workloads.split(","))}
    device = resolve_device(args.device if not args.smoke else "cpu")
    name = "tiny-llama-3" if args.smoke else args.dummy_config
    options: dict[str, Any] = {"device": str(device)}
    chunk = args.chunked_prefill_size or sizes.chunk
    if chunk:
        options["chunked_prefill_size"] = chunk
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"environment": environment(device), "model": name,
                              "sizes": asdict(sizes),
                              "workloads": {name: asdict(w) for name, w in workloads.items()},
                              "host_ratio": args.host_ratio}
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
            report["multi_turn"] = {}
            for label, workload in workloads.items():
                off = multi_turn(dummy.path, options, workload, hicache=False,
                                 host_ratio=args.host_ratio, vocab=vocab)
                on = multi_turn(dummy.path, options, workload, hicache=True,
                                host_ratio=args.host_ratio, vocab=vocab)
                report["multi_turn"][label] = {
                    "without_host_tier": off, "with_host_tier": on, "pool_tokens": workload.pool,
                    "speedup": report_multi_turn(label, workload, off, on)}
    path = write_json(args.output, report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
