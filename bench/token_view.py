"""What a live `TokenView` costs a running program, in many short interleaved paired runs.

Two shapes of program (`ignore_eos`, temperature 1, a seed per gen: every run draws the same
tokens):

- sequential (default): `--gens` gens of `--tokens-per-gen` tokens (default 1 x 1,000) at batch
  1;
- parallel (`--forks N`): the prompt forks into N branches that each write `--gens` gens of
  `--tokens-per-gen` tokens (default 10,000 / N each), all decoding at once (batch N), every
  branch a row of the one live view. `--forks 16` renders 10,000 streamed tokens in every view
  run: the criterion's size, and with a real model on a GPU a token costs the device's time.

Models: by default a 2-layer, 64-wide random Llama (128-wide on a GPU: head size 64) with
SmolLM2's tokenizer, a model that costs almost nothing, so that the host's share, where the
trace and the view's updates compete with the runtime for the GIL, is as large as it gets (on
the H100 a token cost 1.35 ms of host work and blocks varied by +-30%: too noisy to show 5%);
`--dummy-config NAME` random weights of a real architecture (bench/dummy_models.py, e.g.
llama-3-8b, with `--tokenizer`), `--model DIR` a real one. Paths:

- `plain`: the program as usual (streamed);
- `traced`: `token_view=True`: every gen asks for token origins and top-5 logprobs, and the
  program records every token, with no view (the runtime's per-token reporting);
- `view`: traced, with a live view attached: `TokenViewModel`, the widget's own update path
  (its throttle thread at 10 Hz, its row conversion and budget), each update's changed traits
  and token delta serialized as the widget's comm messages would be. It needs no anywidget, so
  the same measurement runs on a GPU host without Jupyter (`--widget` uses the anywidget
  `TokenView` itself, which sets its traits from the same updates).

Slow drift of a host (clocks, other tenants) is larger than 5% between runs tens of seconds
apart, so the paths run in `--blocks` blocks of one short run each, back to back (block b starts
at path b mod 3, so no path always runs first), and each block gives paired ratios (traced /
plain, view / plain) of wall time and of the process's CPU time. The result is the median of
the per-block ratios with a distribution-free confidence interval of that median (order
statistics of the binomial, ~90%: with 8 blocks the 2nd and 7th sorted ratios), the quartiles
and the range. The verdict on `view / plain - 1` (what a user who turns the view on pays) is OK
when the interval's top is below the 5% budget, OVER when its bottom is above it, else
UNRESOLVED (more blocks); the `criterion` line says the same of issue 25's "10,000 streamed
tokens render without slowing the run by more than 5%" (MET only when the top is below 5%), and
notes runs shorter than 10,000 tokens. Beside it, noise-free accounting: the view's own CPU time
(thread time inside its updates, plus its listener on the trace log, which the program threads
call on every streamed chunk: counted, and every 16th call timed) and the paired differences of
each runtime thread's CPU time per token (the runtime's and program's per-token reporting:
scheduler, output and programs threads).

Before the blocks, one full-size view run (not counted) decodes the token texts every later run
repeats (the view caches them per tokenizer; random weights' top-5 alternatives are mostly
distinct ids, which a real model's are not): its own CPU is printed as the first view's. After
them, in the sequential shape, one long view run (`--long-gens` x `--long-tokens-per-gen`,
default 10 x 1,000 = 10,000 streamed tokens; none with `--forks`, whose every view run is that
size) checks that the view shows every token and what its updates cost at that size (their
share of the run, the largest message). Where the per-token time goes: raw `Runtime.generate`
streams of the same requests beside the program (the DSL's share), the forward passes and
CUDA-graph replays per token, the scheduler thread's CPU per token, its stack sampled every 2 ms
over one more plain run (`ThreadProfile`; `--no-profile` skips it) and, on a GPU, the host time
of one batch-1 sampling step (`--sampler-calls`). JSON goes to bench/results/token_view[_cuda].json.

    python bench/token_view.py                     # CPU: 10 blocks x 1,000 tokens + 10,000
    python bench/token_view.py --device cuda       # GPU, tiny model: host-bound, noisy
    python bench/token_view.py --device cuda --dummy-config llama-3-8b \
        --tokenizer .gpu/tokenizer --forks 16 --no-profile   # the criterion (~3 min on an H100)
    python bench/token_view.py --forks 16 --tokens-per-gen 40 --blocks 5   # a CPU check
    python bench/token_view.py --blocks 2 --tokens-per-gen 100 --long-gens 0   # a smoke run

On the H100 the parallel shape decodes batch 16 of a random Llama-3-8B at ~6-7 ms a step: a run
of 10,000 tokens takes ~4-5 s of device-bound decode, the three paths of 8 blocks ~2 minutes.

On the CPU torch runs one intra-op thread unless `--threads` says otherwise: on a busy shared
host a parallel region waits for its descheduled second thread (a sampling step measured 3.5 ms
with one thread, 13.8 ms with two, at load 6 on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16384, bos_token_id=1,
            eos_token_id=2, rms_norm_eps=1e-5, dtype="float32")
# GPU attention kernels take head sizes of 64 and up
TINY_GPU = {**TINY, "hidden_size": 128, "intermediate_size": 256}


BUDGET = 0.05
MODES = ("plain", "traced", "view")
PAIRS = (("traced", "plain"), ("view", "plain"), ("view", "traced"))
PROMPT = "A long story, told in parts.\n"


def tiny_config(device: str) -> dict[str, Any]:
    return TINY if device == "cpu" else TINY_GPU


def make_program(gens: int, tokens: int, forks: int = 0) -> Any:
    """`gens` gens of `tokens` tokens after the prompt, or with `forks`, the prompt forked into
    that many branches that each write `gens` such gens (all at once: one batch)."""
    import lmnb

    def parts(s: Any, seed: int) -> None:
        for i in range(gens):
            s += f"\nPart {i + 1}:" + lmnb.gen(f"part{i}", max_tokens=tokens, ignore_eos=True,
                                               temperature=1.0, seed=seed + i)

    @lmnb.function
    def long_text(s):
        s += PROMPT
        parts(s, 0)

    @lmnb.function
    def forked_text(s):
        s += PROMPT
        for b, branch in enumerate(s.fork(forks)):
            parts(branch, b * gens)

    return forked_text if forks else long_text


class CommStandIn:
    """What an anywidget's comm does with an update: one JSON message of the changed traits
    (`__call__`) and one of the token delta (`send`, a custom message)."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self.delta_bytes = 0  # of the token deltas (the rest: traits, snapshots among them)
        self.largest = 0  # the longest message (the longest serialization under the GIL)

    def __call__(self, changes: dict[str, Any]) -> None:
        self._count({"method": "update", "state": changes})

    def send(self, content: dict[str, Any], buffers: Any = None) -> None:
        self.delta_bytes += self._count({"method": "custom", "content": content})

    def _count(self, message: dict[str, Any]) -> int:
        size = len(json.dumps(message))
        self.messages += 1
        self.bytes += size
        self.largest = max(self.largest, size)
        return size


class ListenerMeter:
    """Stands in for a view's listener on the run's trace log (called by the program threads
    on every streamed chunk): counts the calls and times every `every`-th one (thread CPU), so
    that the metering adds a clock read per `every` calls rather than two per call."""

    def __init__(self, listener: Any, every: int = 16) -> None:
        self.listener = listener
        self.every = every
        self.calls = 0
        self.timed = 0
        self.timed_seconds = 0.0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            self.listener()
            return
        started = time.thread_time()
        self.listener()
        self.timed_seconds += time.thread_time() - started
        self.timed += 1

    @property
    def cpu_seconds(self) -> float:
        """The estimated CPU time of all the calls."""
        return self.timed_seconds / self.timed * self.calls if self.timed else 0.0


def meter_listener(state: Any) -> ListenerMeter | None:
    """Wraps the listener a view just added to `state`'s trace log in a `ListenerMeter`."""
    listeners = state.token_trace.log.listeners
    if not listeners:
        return None
    meter = ListenerMeter(listeners[-1])
    listeners[-1] = meter
    return meter


def attach_view(state: Any, widget: bool) -> tuple[Any, Any, CommStandIn | None]:
    """(view, its model, the comm stand-in) of a running traced program."""
    if widget:
        from lmnb.widgets.token_view import TokenView
        from lmnb.widgets.token_view_model import SYNCED

        comm = CommStandIn()

        class Counted(TokenView):
            def send(self, content: dict[str, Any], buffers: Any = None) -> None:
                comm.send(content)
                super().send(content, buffers)

        view = Counted(state, hz=10.0)
        view.observe(lambda change: comm({change["name"]: change["new"]}), names=list(SYNCED))
        return view, view._model, comm
    from lmnb.widgets.token_view_model import TokenViewModel

    comm = CommStandIn()
    model = TokenViewModel(state, publish=comm, send=comm.send, hz=10.0)
    return model, model, comm


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far per live Python thread of this process, by thread name, to the
    nanosecond (POSIX per-thread clocks); the rest of the process (torch's worker threads) as
    `native`."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
        except (OSError, AttributeError):  # ended meanwhile; no per-thread clocks here
            continue
        out[thread.name] = out.get(thread.name, 0.0) + seconds
    out["native"] = time.process_time() - sum(out.values())
    return out


class ThreadProfile:
    """Samples one thread's Python stack (by thread name) every `interval` seconds on a thread of
    its own: per function (file:name, lmnb's and torch's), the share of samples it was on the
    stack. Where a host-bound thread's wall time goes, C++ calls charged to their Python
    caller."""

    def __init__(self, name: str, interval: float = 0.002) -> None:
        self.name = name
        self.interval = interval
        self.inclusive: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-profile", daemon=True)

    def __enter__(self) -> ThreadProfile:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            target = next((t.ident for t in threading.enumerate() if t.name == self.name), None)
            frame = sys._current_frames().get(target or -1)
            if frame is None:
                continue
            self.samples += 1
            names = set()
            while frame is not None:
                code = frame.f_code
                path = code.co_filename
                short = path.split("/lmnb/", 1)[1] if "/lmnb/" in path else path.rsplit("/", 1)[-1]
                names.add(f"{short}:{code.co_name}")
                frame = frame.f_back
            self.inclusive.update(names)

    def top(self, count: int) -> list[tuple[str, float]]:
        ranked = [(name, n) for name, n in self.inclusive.most_common()
                  if not name.startswith("threading.py:")]
        return [(name, n / max(self.samples, 1)) for name, n in ranked[:count]]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear between order statistics)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval of the median of `values`: order statistics (k, n + 1 - k)
    with k the largest such that P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (the range
    when n < 5, which no k allows)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # P(Binomial < k + 1)
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def spread(values: list[float]) -> dict[str, float]:
    low, high = median_interval(values)
    return {"median": statistics.median(values), "ci90_low": low, "ci90_high": high,
            "q25": quantile(values, 0.25), "q75": quantile(values, 0.75),
            "min": min(values), "max": max(values), "n": len(values)}


def stats_counters(runtime: Any) -> dict[str, int]:
    stats = runtime.stats()
    return {key: int(stats.get(key) or 0)
            for key in ("forward_passes", "cuda_graph_replays", "generated_tokens")}


def run_once(program: Any, runtime: Any, backend: Any, mode: str,
             widget: bool) -> dict[str, Any]:
    """One run of `program` by path `mode`, from an empty prefix cache."""
    from bench.common import synchronize

    runtime.flush_cache()
    counters = stats_counters(runtime)
    device = runtime.device
    synchronize(device)
    threads_before = thread_cpu()
    wall, cpu = time.perf_counter(), time.process_time()
    state = program.run(backend=backend, stream=True, token_view=mode != "plain")
    view = model = comm = None
    meter = None
    if mode == "view":
        view, model, comm = attach_view(state, widget)
        meter = meter_listener(state)
    state.sync()
    state.run.settle()  # the forks too
    synchronize(device)
    out: dict[str, Any] = {"mode": mode, "seconds": time.perf_counter() - wall,
                           "cpu_seconds": time.process_time() - cpu}
    after = thread_cpu()  # threads that ended during the run are missing
    out["thread_cpu_seconds"] = {name: round(seconds - threads_before.get(name, 0.0), 5)
                                 for name, seconds in after.items()
                                 if seconds - threads_before.get(name, 0.0) > 0}
    executors = state.run.executors
    metas = list({id(meta): meta for executor in executors  # forks copy their parent's
                  for meta in executor.meta_info.values()}.values())
    out["tokens"] = sum(meta["completion_tokens"] for meta in metas)
    texts = "\0".join(executor.text() for executor in executors)
    out["text_hash"] = hashlib.sha1(texts.encode()).hexdigest()[:12]
    if mode != "plain":  # the trace's size: one origin run per gen, a logprob per token
        out["origin_spans"] = sum(len(meta["output_token_origins"]) for meta in metas)
    if view is not None:  # its updates while the program ran; then its final state
        out.update(flushes=model.flushes, flush_seconds=model.flush_seconds,
                   flush_cpu_seconds=model.flush_cpu_seconds, comm_messages=comm.messages,
                   comm_bytes=comm.bytes, comm_delta_bytes=comm.delta_bytes,
                   comm_largest_bytes=comm.largest)
        if meter is not None:
            out.update(listener_calls=meter.calls, listener_cpu_seconds=meter.cpu_seconds)
        shown_live = sum(model.counts.values())  # what it showed as the run ended
        view.refresh()
        out["shown_live_share"] = shown_live / max(sum(model.counts.values()), 1)
        out["shown_generated"] = model.counts["generated"]
        out["rows"] = len(model.rows)
        view.close()
        if meter is not None:
            state.token_trace.log.listeners.remove(meter)
    after_counters = stats_counters(runtime)
    out.update({key: after_counters[key] - counters[key] for key in counters})
    return out


def raw_once(runtime: Any, tokens: int, requests: int = 1) -> dict[str, Any]:
    """The program's first gen (of each fork, with `requests` > 1) as streamed
    `Runtime.generate` requests of `tokens` tokens (no DSL, no program threads): the runtime's
    own time per token."""
    from bench.common import synchronize

    runtime.flush_cache()
    counters = stats_counters(runtime)
    synchronize(runtime.device)
    wall, cpu = time.perf_counter(), time.process_time()
    params = [dict(max_new_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i)
              for i in range(requests)]
    prompt = PROMPT + "\nPart 1:"
    stream = (runtime.generate(prompt, params[0], stream=True) if requests == 1 else
              runtime.generate([prompt] * requests, params, stream=True))
    chunks = sum(1 for _ in stream)
    synchronize(runtime.device)
    out = {"mode": "raw", "seconds": time.perf_counter() - wall,
           "cpu_seconds": time.process_time() - cpu, "tokens": tokens * requests,
           "requests": requests, "chunks": chunks}
    after = stats_counters(runtime)
    out.update({key: after[key] - counters[key] for key in counters})
    return out

def build_runtime(args: argparse.Namespace, scratch: str) -> tuple[Any, str]:
    """The runtime and its model's label: `--model`, `--dummy-config` or the tiny random Llama,
    its KV pool sized for the largest run (a sequence's context for the longest gen chain, the
    pool for every branch at once)."""
    from bench.dummy_models import write_dummy_model
    from lmnb.runtime.engine import Runtime
    from lmnb.runtime.models import loader

    sequence = max(args.gens * (args.tokens_per_gen + 16),
                   args.long_gens * (args.long_tokens_per_gen + 16))
    context = 2 * sequence + 256  # random text re-tokenizes longer
    pool = max(args.forks, 1) * context
    common: dict[str, Any] = dict(device=args.device, max_total_tokens=pool + 1024,
                                  context_length=max(context, 2048))
    if args.model:
        return Runtime(args.model, dtype=args.dtype or default_dtype(args.device), **common), \
            args.model
    if args.dummy_config:
        dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
        options = dummy.runtime_options()
        if args.dtype:
            options["dtype"] = args.dtype
        return Runtime(str(dummy.path), **options, **common), dummy.label
    tokenizer_dir = loader.resolve_model_dir(args.tokenizer)
    folder = Path(scratch) / "tiny"
    folder.mkdir()
    config = {**tiny_config(args.device), "max_position_embeddings": max(context, 2048),
              "vocab_size": len(loader.load_tokenizer(tokenizer_dir))}
    (folder / "config.json").write_text(json.dumps(config))
    runtime = Runtime(str(folder), tokenizer_path=str(tokenizer_dir), load_format="dummy",
                      dtype=args.dtype or default_dtype(args.device), **common)
    return runtime, f"tiny random Llama ({config['hidden_size']} wide, 2 layers)"


def default_dtype(device: str) -> str:
    return "float32" if device == "cpu" else "bfloat16"


def sampler_host_cost(device: str, vocab: int, calls: int) -> dict[str, float]:
    """Host microseconds per batch-1 sampling step (temperature 1, as the bench's gens): the
    step without logprobs, with top-5 logprobs as the runtime computes them (`sample_top5`), and
    the packed logprobs alone from the GPU kernel and from the torch ops it replaces. Calls are
    issued in groups of 16 between waits, and only the issuing is timed: at batch 1 the host's
    time per op is what a decode step pays."""
    import torch

    from bench.common import synchronize
    from lmnb.runtime.core import Req, SamplingParams
    from lmnb.runtime.sampling import Sampler
    from lmnb.runtime.sampling.logprob_kernel import packed_logprobs
    from lmnb.runtime.sampling.sampler import torch_packed_logprobs
    from lmnb.runtime.scheduler import ReqState

    sampler = Sampler(vocab, {2})
    logits = torch.randn(1, vocab, device=device) * 3
    ids = torch.zeros(1, dtype=torch.int64, device=device)

    def info(top: int) -> Any:
        req = Req(origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=1.0),
                  return_logprob=top > 0, top_logprobs_num=top)
        return sampler.batch_info([ReqState(req)], device)

    def host_us(step: Any) -> float:
        for _ in range(16):
            step()
        synchronize(device)
        issued = 0.0
        for _ in range(max(calls // 16, 1)):
            start = time.perf_counter()
            for _ in range(16):
                step()
            issued += time.perf_counter() - start
            synchronize(device)
        return 1e6 * issued / (16 * max(calls // 16, 1))

    plain, traced = info(0), info(5)
    out = {"sample": host_us(lambda: sampler(logits, plain)),
           "sample_top5": host_us(lambda: sampler(logits, traced)),
           "packed_torch": host_us(lambda: torch_packed_logprobs(logits, ids, 5))}
    if device != "cpu":
        out["packed_kernel"] = host_us(lambda: packed_logprobs(logits, ids, 5))
    return out


def paired(runs: list[dict[str, Any]], a: str, b: str, key: str) -> list[float]:
    """Per block, run `a`'s `key` over run `b`'s."""
    return [block[a][key] / block[b][key] for block in runs]


def per_token_threads(blocks: list[dict[str, dict[str, Any]]], mode: str,
                      tokens: int) -> dict[str, dict[str, float]]:
    """Per thread: its CPU microseconds per token in `mode` (median) and the median of the
    paired differences from `plain`."""
    names = sorted({name for block in blocks for m in (mode, "plain")
                    for name in block[m]["thread_cpu_seconds"]})
    out = {}
    for name in names:
        own = [block[mode]["thread_cpu_seconds"].get(name, 0.0) for block in blocks]
        base = [block["plain"]["thread_cpu_seconds"].get(name, 0.0) for block in blocks]
        out[name] = {"us_per_token": 1e6 * statistics.median(own) / tokens,
                     "minus_plain_us": 1e6 * statistics.median(
                         o - p for o, p in zip(own, base, strict=True)) / tokens}
    return out


def verdict(ratio: dict[str, float]) -> str:
    """OK / OVER / UNRESOLVED from a `spread` of ratios (fewer than 5 have no 90% interval)."""
    low, high = ratio["ci90_low"], ratio["ci90_high"]
    if ratio["n"] < 5:
        return "UNRESOLVED"
    if high - 1 < BUDGET:
        return "OK"
    return "OVER" if low - 1 > BUDGET else "UNRESOLVED"


CRITERION_TOKENS = 10_000


def criterion_line(ratio: dict[str, float], tokens: int) -> str:
    """Issue 25's criterion ("10,000 streamed tokens render without slowing the run by more than
    5%") from the view / plain `spread` of runs of `tokens` streamed tokens: met only when the
    90% interval's top is below 5%."""
    low, high = 100 * (ratio["ci90_low"] - 1), 100 * (ratio["ci90_high"] - 1)
    size = ("" if tokens >= CRITERION_TOKENS else
            f" (runs of {tokens:,} streamed tokens, fewer than the criterion's "
            f"{CRITERION_TOKENS:,})")
    budget = 100 * BUDGET
    if ratio["n"] < 5:
        said = f"not settled: {ratio['n']} blocks give no 90% interval"
    elif high < budget:
        said = f"MET: the 90% CI's top, {high:+.1f}%, is below {budget:.0f}%"
    elif low > budget:
        said = f"NOT MET: the whole 90% CI ({low:+.1f}% .. {high:+.1f}%) is above {budget:.0f}%"
    else:
        said = (f"not settled: the 90% CI ({low:+.1f}% .. {high:+.1f}%) straddles "
                f"{budget:.0f}% (more blocks narrow it)")
    return f"criterion, a live view slows the run by < {budget:.0f}%: {said}{size}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gens", type=int, default=1,
                        help="gens per short run (with --forks: per branch)")
    parser.add_argument("--tokens-per-gen", type=int, default=None,
                        help="default: 1,000; with --forks, 10,000 / forks")
    parser.add_argument("--forks", type=int, default=0,
                        help="the parallel shape: the prompt forks into this many branches, "
                             "each a row of the view, all decoding at once (0: one sequence)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="blocks of paired short runs (default: 10 on the CPU, 8 on a GPU)")
    parser.add_argument("--long-gens", type=int, default=None,
                        help="gens of the long view run (0: none; default 10, with --forks "
                             "0: each block's view run is the long run)")
    parser.add_argument("--long-tokens-per-gen", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, else bfloat16")
    parser.add_argument("--model", default=None, help="a model folder (default: tiny random)")
    parser.add_argument("--dummy-config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="random weights of a real architecture (bench/dummy_models.py), "
                             "e.g. llama-3-8b on a GPU: a token costs the device's time")
    parser.add_argument("--tokenizer", default=os.environ.get("LMNB_TOKENIZER_DIR"),
                        help="tokenizer folder (default: $LMNB_TOKENIZER_DIR, else the embedded "
                             "SmolLM2's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default on the CPU: 1, as a parallel "
                             "region stalls on a busy shared host; a GPU: torch's)")
    parser.add_argument("--sampler-calls", type=int, default=None,
                        help="batch-1 sampling steps timed on the host first (default: 1000 on "
                             "a GPU, 0 on the CPU)")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled plain run (the scheduler thread's stack sampled "
                             "every 2 ms: where a token's host time goes)")
    parser.add_argument("--widget", action="store_true",
                        help="the anywidget TokenView rather than its model alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.model and args.dummy_config:
        raise SystemExit("--model and --dummy-config exclude each other")
    if args.blocks is None:
        args.blocks = 10 if args.device == "cpu" else 8
    if args.tokens_per_gen is None:
        args.tokens_per_gen = -(-10_000 // (args.forks * args.gens)) if args.forks else 1000
    if args.long_gens is None:
        args.long_gens = 0 if args.forks else 10

    from transformers.utils import logging as hf_logging

    from lmnb.lang.backends.local import LocalBackend
    from lmnb.widgets.token_view_model import MAX_FLUSH_SHARE

    hf_logging.set_verbosity_error()
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmnb-token-view-") as scratch:
        runtime, label = build_runtime(args, scratch)
    built = time.perf_counter() - started
    stats = runtime.stats()
    setup = {key: stats.get(key) for key in ("attention_backend", "cuda_graph_batch_sizes",
                                             "overlap_schedule", "fused_kernels")}
    print(f"{label}: runtime built in {built:.1f} s: {setup}", flush=True)
    branches = max(args.forks, 1)
    tokens = branches * args.gens * args.tokens_per_gen
    long_run: dict[str, Any] | None = None
    try:
        calls = args.sampler_calls if args.sampler_calls is not None else (
            0 if args.device == "cpu" else 1000)
        sampler_cost = (sampler_host_cost(args.device, runtime.model_config.vocab_size, calls)
                        if calls else {})
        if sampler_cost:
            print("host us per batch-1 sampling step: " + ", ".join(
                f"{name} {value:.1f}" for name, value in sampler_cost.items()), flush=True)
        backend = LocalBackend(runtime)
        program = make_program(args.gens, args.tokens_per_gen, args.forks)
        warm = make_program(1, 64, args.forks)
        for mode in MODES:
            run_once(warm, runtime, backend, mode, args.widget)
        # a full-size view run, not counted: it decodes the token texts (the sampled tokens
        # and their top-5 alternatives, cached per tokenizer) that every later run repeats
        cold = run_once(program, runtime, backend, "view", args.widget)
        profile = None  # a full-size plain run first, not counted (profiled: sampling adds)
        if args.no_profile:
            run_once(program, runtime, backend, "plain", args.widget)
        else:
            with ThreadProfile("lmnb-scheduler") as profile:
                run_once(program, runtime, backend, "plain", args.widget)
        raw = raw_once(runtime, args.tokens_per_gen, branches)
        blocks: list[dict[str, dict[str, Any]]] = []
        for b in range(args.blocks):
            block = {}
            for k in range(len(MODES)):
                mode = MODES[(b + k) % len(MODES)]
                block[mode] = run_once(program, runtime, backend, mode, args.widget)
            blocks.append(block)
            extra = block["view"]["seconds"] / block["plain"]["seconds"] - 1
            print(f"block {b + 1:2d}: " + "  ".join(
                f"{mode} {block[mode]['seconds']:.3f} s" for mode in MODES)
                + f"  view/plain {100 * extra:+.1f}%", flush=True)
        if args.long_gens:
            long_run = run_once(make_program(args.long_gens, args.long_tokens_per_gen),
                                runtime, backend, "view", args.widget)
    finally:
        runtime.close()

    summary: dict[str, Any] = {
        "paths": {mode: {key: spread([block[mode][key] for block in blocks])
                         for key in ("seconds", "cpu_seconds")} for mode in MODES},
        "ratios": {f"{a}/{b}": {key: spread(paired(blocks, a, b, key))
                                for key in ("seconds", "cpu_seconds")} for a, b in PAIRS},
        "threads_per_token": {mode: per_token_threads(blocks, mode, tokens)
                              for mode in ("traced", "view")},
        "same_text": len({r["text_hash"] for block in blocks for r in block.values()}) == 1}
    views = [block["view"] for block in blocks]
    own = [r["flush_cpu_seconds"] + r.get("listener_cpu_seconds", 0.0) for r in views]
    summary["view_own_cpu"] = {
        "share_of_wall": spread([o / r["seconds"] for o, r in zip(own, views, strict=True)]),
        "us_per_token": 1e6 * statistics.median(own) / tokens,
        "updates_us_per_token": 1e6 * statistics.median(
            r["flush_cpu_seconds"] for r in views) / tokens,
        "listener_us_per_token": 1e6 * statistics.median(
            r.get("listener_cpu_seconds", 0.0) for r in views) / tokens,
        "listener_calls": statistics.median(r.get("listener_calls", 0) for r in views)}

    def pct(s: dict[str, float], key: str) -> float:
        return 100 * (s[key] - 1)

    shape = (f"{args.forks} forks x {args.gens * args.tokens_per_gen:,} tokens, batch "
             f"{args.forks}" if args.forks else "batch 1")
    print(f"\n{label}: {args.blocks} blocks of {tokens:,} tokens per path ({shape}); "
          f"same text on every path: {summary['same_text']}")
    print(format_table(
        ["path", "wall s (median)", "q25", "q75", "cpu s (median)", "us/token", "passes/token"],
        [[mode, s["seconds"]["median"], s["seconds"]["q25"], s["seconds"]["q75"],
          s["cpu_seconds"]["median"], 1e6 * s["seconds"]["median"] / tokens,
          statistics.median(block[mode]["forward_passes"] for block in blocks) / tokens]
         for mode, s in summary["paths"].items()]))
    print(format_table(
        ["paired per block", "wall % (median)", "90% CI low", "high", "q25", "q75",
         "cpu % (median)", "cpu CI low", "high"],
        [[pair, pct(r["seconds"], "median"), pct(r["seconds"], "ci90_low"),
          pct(r["seconds"], "ci90_high"), pct(r["seconds"], "q25"), pct(r["seconds"], "q75"),
          pct(r["cpu_seconds"], "median"), pct(r["cpu_seconds"], "ci90_low"),
          pct(r["cpu_seconds"], "ci90_high")]
         for pair, r in summary["ratios"].items()]))
    for mode, threads in summary["threads_per_token"].items():
        print(f"{mode}: CPU us per token by thread (minus plain's, paired median): " + ", ".join(
            f"{name} {t['us_per_token']:.0f} ({t['minus_plain_us']:+.0f})"
            for name, t in threads.items()))
    own_cpu = summary["view_own_cpu"]
    share = own_cpu["share_of_wall"]
    print(f"view's own CPU: {own_cpu['us_per_token']:.1f} us per token (its updates "
          f"{own_cpu['updates_us_per_token']:.1f}, {own_cpu['listener_calls']:.0f} token events "
          f"to its listener {own_cpu['listener_us_per_token']:.2f}), "
          f"{100 * share['median']:.2f}% of the wall time (max {100 * share['max']:.2f}%; "
          f"updates' budget {100 * MAX_FLUSH_SHARE:.0f}%), "
          f"{statistics.median(r['flushes'] for r in views):.0f} updates per run")
    print(f"each view run: {statistics.median(r['shown_generated'] for r in views):,.0f} "
          f"generated tokens shown (median) in {views[0]['rows']} row"
          f"{'s' if views[0]['rows'] != 1 else ''}, "
          f"{100 * statistics.median(r['shown_live_share'] for r in views):.0f}% of its tokens "
          f"already shown as the run ended (median; min "
          f"{100 * min(r['shown_live_share'] for r in views):.0f}%), "
          f"{statistics.median(r['comm_bytes'] for r in views) / 1e6:.2f} MB of comm JSON "
          f"(largest message {max(r['comm_largest_bytes'] for r in views) / 1e3:.0f} kB)")

    plain_us = 1e6 * summary["paths"]["plain"]["seconds"]["median"] / tokens
    scheduler_us = statistics.median(
        block["plain"]["thread_cpu_seconds"].get("lmnb-scheduler", 0.0)
        for block in blocks) * 1e6 / tokens
    graphs = statistics.median(block["plain"]["cuda_graph_replays"] for block in blocks)
    passes = statistics.median(block["plain"]["forward_passes"] for block in blocks)
    print(f"per token, plain: {plain_us:.0f} us wall, {scheduler_us:.0f} us of scheduler-thread "
          f"CPU, {passes / tokens:.2f} forward passes ({graphs / max(passes, 1):.0%} CUDA-graph "
          f"replays); raw Runtime.generate streams ({raw['requests']} x "
          f"{raw['tokens'] // raw['requests']:,} tokens, no DSL): "
          f"{1e6 * raw['seconds'] / raw['tokens']:.0f} us wall, "
          f"{1e6 * raw['cpu_seconds'] / raw['tokens']:.0f} us process CPU"
          + (f"; sampling step host time {sampler_cost['sample']:.0f} us (with top-5: "
             f"{sampler_cost['sample_top5']:.0f})" if sampler_cost else ""))
    print(f"the first full-size view run (token texts not yet cached): {cold['seconds']:.2f} s, "
          f"the view's own updates {1e6 * cold['flush_cpu_seconds'] / cold['tokens']:.1f} us CPU "
          f"per token, {100 * cold['flush_cpu_seconds'] / cold['seconds']:.2f}% of the run")
    if profile is not None:
        print(f"scheduler thread, the first plain run ({profile.samples} stack samples), share of "
              "samples per function on the stack: " + ", ".join(
                  f"{name} {100 * share:.0f}%" for name, share in profile.top(28)))
    if long_run is not None:
        long_tokens = long_run["tokens"]
        print(f"long view run: {long_tokens:,} streamed tokens in {long_run['seconds']:.2f} s "
              f"({1e6 * long_run['seconds'] / long_tokens:.0f} us/token), "
              f"{long_run['shown_generated']:,} generated tokens shown, "
              f"{long_run['flushes']} updates, the view's own CPU "
              f"{100 * long_run['flush_cpu_seconds'] / long_run['seconds']:.2f}% of the run, "
              f"{long_run['comm_bytes'] / 1e6:.2f} MB of comm JSON (largest message "
              f"{long_run['comm_largest_bytes'] / 1e3:.0f} kB)")
    ratio = summary["ratios"]["view/plain"]["seconds"]
    result = verdict(ratio)
    print(f"view vs plain (what the user pays), median of {args.blocks} paired blocks: "
          f"{pct(ratio, 'median'):+.1f}% (90% CI {pct(ratio, 'ci90_low'):+.1f}% .. "
          f"{pct(ratio, 'ci90_high'):+.1f}%): {result} (budget {100 * BUDGET:.0f}%)")
    criterion = criterion_line(ratio, tokens)
    print(criterion)
    default = RESULTS_DIR / ("token_view.json" if args.device == "cpu"
                             else f"token_view_{args.device.split(':')[0]}.json")
    path = write_json(args.out or default, {
        "benchmark": "token_view", "environment": environment(args.device), "args": vars(args),
        "model": label, "model_config": None if args.model or args.dummy_config
        else tiny_config(args.device), "runtime": setup,
        "runtime_build_seconds": built, "blocks": blocks, "raw": raw, "long_view": long_run,
        "cold_view": cold,
        "summary": summary, "view_update_budget": MAX_FLUSH_SHARE,
        "feature_overhead": ratio["median"] - 1, "verdict": result, "budget": BUDGET,
        "criterion": criterion,
        "sampler_host_us": sampler_cost,
        "scheduler_profile": profile.top(60) if profile is not None else None,
        "total_seconds": time.perf_counter() - started})
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
