"""lmnb against vLLM on the same GPU in one run: the same workloads, the same random weights of a
real architecture, the same prompt token ids, each engine in its own process, one after the other.

The parent builds the model folders (config.json of a bench/dummy_models.py architecture plus the
real tokenizer's files) and runs `python bench/vs_vllm.py --engine vllm|lmnb ... --json-out F` for
each engine in turn (never both on the GPU at once); a child builds its engine once, then per
workload runs it once untimed (warm-up) and `--repeats` times timed, the prefix cache emptied
before every run (vLLM `reset_prefix_cache()`, lmnb `flush_cache()`), and keeps the median.
Sampling everywhere: `ignore_eos`, so every request generates exactly its requested length.

Workloads (`--workloads`, default all on Llama-3-8B, `offline` only on Llama-2-7B):
  offline      nano-vllm's: 256 seqs, input and output lengths uniform in 100-1024, temperature
               0.6 (bench/offline.py's draw: seed 0, ids < 10000), one `generate` call
  prefix-ids   8 prefixes of 1,500 random ids x 32 questions of 40 ids, 16 output tokens,
               greedy; all 256 prompts in one call, grouped by prefix
  prefix-text  the same shape as text: 8 prefixes of 1,400 words x 32 questions of 30 words
               (seeded draws from a fixed word list); each engine tokenizes the strings with the
               model folder's tokenizer (Llama-3's, see bench/fetch_tokenizers.sh); models whose
               vocabulary is smaller than the tokenizer's skip it
  fork         64 documents of 600 ids, each followed by 4 different 32-id questions, 64 output
               tokens, greedy (branch-solve-merge shape)
  decode-b64   64 distinct 512-id prompts decoding together: ms per decode step as
               (T(16 + 128 tokens) - T(16 tokens)) / 128 from the median times of the two lengths
  decode-b1    one 128-id prompt, the same way with 256 steps
and always `start`: seconds from the child process's start (/proc) to a ready engine (imports,
weights, compilation, CUDA graphs), and the engine constructor alone. `--cold-caches` gives each
child empty compile caches (Triton, TorchInductor, vLLM's, FlashInfer's JIT), so that the start
is a fresh machine's whichever engine ran before on the same one.

Both engines get the same prompts (ids or strings); each child reports a digest of every
workload and the prompt/output token counts it saw, and the parent flags a row where they differ.
Output: one table (vLLM and lmnb seconds or ms/step, output tokens/s, lmnb/vLLM = vLLM time /
lmnb time, > 1 when lmnb is faster), bench/results/vs_vllm.json (copied into $OUT when set).

GPU machine (bench/vllm_peer.sh installs vLLM 0.26.0 into /tmp/vllm-site; the Llama-3 tokenizer
comes from .gpu/tokenizer-llama3, see bench/fetch_tokenizers.sh):
    python bench/vs_vllm.py                                   # Llama-3-8B all, Llama-2-7B offline
    python bench/vs_vllm.py --models llama-3-8b --workloads offline,prefix-text --repeats 5
    python bench/vs_vllm.py --skip-vllm --lmnb-backend triton --profile
CPU check (lmnb only, a tiny random Llama-3-shaped model with the real tokenizer, small sizes):
    python bench/vs_vllm.py --tiny --skip-vllm
    python bench/vs_vllm.py --tiny --engine lmnb              # the child alone, its own table
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

_MODULE_T0 = time.perf_counter()  # fallback for the process's start when /proc is not there

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    format_markdown_table,
    format_table,
    write_results,
)
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402

ENGINES = ("vllm", "lmnb")
WORKLOADS = ("offline", "prefix-ids", "prefix-text", "fork", "decode-b64", "decode-b1")
DEFAULT_MODELS = ("llama-3-8b", "llama-2-7b")
# Workloads of a model when --workloads is not given (default: all).
MODEL_WORKLOADS: dict[str, tuple[str, ...]] = {"llama-2-7b": ("offline",)}
TINY_MODEL = "tiny-llama-3"
DEFAULT_TOKENIZER_DIR = REPO_ROOT / ".gpu" / "tokenizer-llama3"
DEFAULT_VLLM_SITE = Path("/tmp/vllm-site")
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
OFFLINE_TEMPERATURE = 0.6  # nano-vllm's
MAX_PROMPT_ID = 10000  # random prompt ids are drawn below this (as nano-vllm's)

# Words of the text workload's prompts (each one token with its leading space in Llama-3's BPE,
# most in any BPE); drawn with a seeded generator, so the strings are the same in every process.
WORDS = tuple("""
the of and to in is was for on that with as by at from his her their they this which be are
have has had not but or an it its one all were when there can more other some time what into
would only new these two may first then do any like my now over such our man me even most made
after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get
here between both life being under never day same another know while last might us great old
year off come since against go came right used take three house small large city water river
road garden market village school letter number morning evening window table paper music field
mountain island forest summer winter spring autumn bridge station harbour valley engine
""".split())


# ---- workloads ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Every size of every workload (FULL is the issue's; TINY a CPU check's)."""

    offline_seqs: int = 256
    offline_min_len: int = 100
    offline_max_len: int = 1024
    prefix_groups: int = 8
    prefix_len: int = 1500
    prefix_questions: int = 32
    question_len: int = 40
    prefix_output: int = 16
    text_prefix_words: int = 1400
    text_question_words: int = 30
    fork_docs: int = 64
    fork_doc_len: int = 600
    fork_questions: int = 4
    fork_question_len: int = 32
    fork_output: int = 64
    decode_batch: int = 64
    decode_prompt_len: int = 512
    decode_steps: int = 128
    b1_prompt_len: int = 128
    b1_steps: int = 256
    decode_first: int = 16  # T(first) is subtracted from T(first + steps)


FULL = Sizes()
TINY = Sizes(offline_seqs=8, offline_min_len=8, offline_max_len=48, prefix_groups=2,
             prefix_len=64, prefix_questions=4, question_len=8, prefix_output=4,
             text_prefix_words=48, text_question_words=6, fork_docs=3, fork_doc_len=32,
             fork_questions=4, fork_question_len=8, fork_output=6, decode_batch=4,
             decode_prompt_len=32, decode_steps=6, b1_prompt_len=16, b1_steps=8, decode_first=2)


@dataclass(frozen=True)
class Requests:
    """A throughput workload: every prompt (ids or text) in one `generate` call."""

    name: str
    label: str
    prompts: list[list[int]] | list[str]
    max_tokens: list[int]
    temperature: float

    @property
    def is_text(self) -> bool:
        return bool(self.prompts) and isinstance(self.prompts[0], str)

    def digest(self) -> str:
        return _digest([self.prompts, self.max_tokens, self.temperature])


@dataclass(frozen=True)
class DecodeSteps:
    """Time per decode step of `prompts` decoding together, greedy: (T(first + steps) -
    T(first)) / steps."""

    name: str
    label: str
    prompts: list[list[int]]
    first: int
    steps: int

    def digest(self) -> str:
        return _digest([self.prompts, self.first, self.steps])


Workload = Requests | DecodeSteps


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]


def _ids(rng: random.Random, count: int, top: int) -> list[int]:
    return [rng.randrange(top) for _ in range(count)]


def _seed(name: str) -> int:
    """A fixed seed per workload (independent of which others run)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def make_workload(name: str, sizes: Sizes, vocab_size: int) -> Workload:
    """The workload `name` at `sizes`, deterministic (seeded), for a model of `vocab_size`."""
    from bench.offline import make_workload as offline_workload

    top = min(MAX_PROMPT_ID, vocab_size)
    rng = random.Random(_seed(name))
    s = sizes
    if name == "offline":
        w = offline_workload(num_seqs=s.offline_seqs, min_input_len=s.offline_min_len,
                             max_input_len=s.offline_max_len, min_output_len=s.offline_min_len,
                             max_output_len=s.offline_max_len, vocab_size=vocab_size)
        return Requests(name, f"offline {s.offline_seqs} seqs, T {OFFLINE_TEMPERATURE}",
                        w.prompts, w.output_lens, OFFLINE_TEMPERATURE)
    if name == "prefix-ids":
        prompts = [prefix + _ids(rng, s.question_len, top)
                   for prefix in (_ids(rng, s.prefix_len, top) for _ in range(s.prefix_groups))
                   for _ in range(s.prefix_questions)]
        return Requests(name, f"shared prefix ids {s.prefix_groups}x{s.prefix_questions}",
                        prompts, [s.prefix_output] * len(prompts), 0.0)
    if name == "prefix-text":
        texts = [f"{prefix}\n\nQuestion {q + 1}: {_words(rng, s.text_question_words)}?\nAnswer:"
                 for prefix in (_words(rng, s.text_prefix_words) for _ in range(s.prefix_groups))
                 for q in range(s.prefix_questions)]
        return Requests(name, f"shared prefix text {s.prefix_groups}x{s.prefix_questions}",
                        texts, [s.prefix_output] * len(texts), 0.0)
    if name == "fork":
        prompts = [doc + _ids(rng, s.fork_question_len, top)
                   for doc in (_ids(rng, s.fork_doc_len, top) for _ in range(s.fork_docs))
                   for _ in range(s.fork_questions)]
        return Requests(name, f"fork {s.fork_docs}x{s.fork_questions}", prompts,
                        [s.fork_output] * len(prompts), 0.0)
    if name == "decode-b64":
        return DecodeSteps(name, f"decode b{s.decode_batch} ({s.decode_prompt_len}-token)",
                           _distinct_prompts(rng, s.decode_batch, s.decode_prompt_len, top),
                           s.decode_first, s.decode_steps)
    if name == "decode-b1":
        return DecodeSteps(name, f"decode b1 ({s.b1_prompt_len}-token)",
                           _distinct_prompts(rng, 1, s.b1_prompt_len, top), s.decode_first,
                           s.b1_steps)
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def _distinct_prompts(rng: random.Random, count: int, length: int, top: int) -> list[list[int]]:
    """`count` random prompts with distinct first ids (no prefix shared between them)."""
    firsts = rng.sample(range(top), count)
    return [[first, *_ids(rng, length - 1, top)] for first in firsts]


# ---- engines ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunCounts:
    """What one `generate` call did, as the engine reports it."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None


class Engine(Protocol):
    def prepare(self, prompts: Sequence[list[int]] | Sequence[str], max_tokens: Sequence[int],
                temperature: float) -> object:
        """The engine's request objects (built outside the timed region)."""

    def run(self, prepared: object) -> RunCounts:
        """One blocking `generate` call over every prepared request."""

    def reset_cache(self) -> bool:
        """Empties the prefix cache; False when the engine refuses (work still in flight)."""

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class LmnbEngine:
    def __init__(self, model_dir: Path, *, dtype: str, device: str, backend: str | None,
                 mem_fraction: float | None, chunk: int | None = None,
                 conservativeness: float = 1.0, policy: str = "lpm") -> None:
        from lmnb.runtime.engine import Runtime

        self.rt = Runtime(model_dir, load_format="dummy", dtype=dtype, device=device,
                          attention_backend=backend, mem_fraction_static=mem_fraction,
                          chunked_prefill_size=chunk, schedule_conservativeness=conservativeness,
                          schedule_policy=policy)

    def prepare(self, prompts: Sequence[list[int]] | Sequence[str], max_tokens: Sequence[int],
                temperature: float) -> tuple[list[Any], list[dict[str, Any]]]:
        params = [{"max_new_tokens": n, "ignore_eos": True, "temperature": temperature}
                  for n in max_tokens]
        return list(prompts), params

    def run(self, prepared: object) -> RunCounts:
        prompts, params = prepared  # type: ignore[misc]
        if prompts and isinstance(prompts[0], str):
            outs = self.rt.generate(prompts, sampling_params=params)
        else:
            outs = self.rt.generate(input_ids=prompts, sampling_params=params)
        metas = [out["meta_info"] for out in outs]
        return RunCounts(len(metas), sum(m["prompt_tokens"] for m in metas),
                         sum(m["completion_tokens"] for m in metas),
                         sum(m.get("cached_tokens", 0) for m in metas))

    def reset_cache(self) -> bool:
        return self.rt.flush_cache()

    def forward_passes(self) -> int:
        return int(self.rt.stats()["forward_passes"])

    def info(self) -> dict[str, Any]:
        stats = self.rt.stats()
        keys = ("attention_backend", "cuda_graph_batch_sizes", "cuda_graph_capture_seconds",
                "overlap_schedule", "fused_kernels")
        return {"dtype": str(self.rt.dtype).removeprefix("torch."),
                "device": str(self.rt.device), "max_total_tokens": self.rt.max_total_tokens,
                "context_len": self.rt.context_len, **{k: stats.get(k) for k in keys}}

    def close(self) -> None:
        self.rt.close()


class VllmEngine:
    def __init__(self, model_dir: Path, *, dtype: str, max_model_len: int,
                 gpu_memory_utilization: float) -> None:
        try:
            from vllm import LLM
        except ImportError as error:
            raise SystemExit(f"vllm does not import ({error}); bench/vllm_peer.sh installs it "
                             "into /tmp/vllm-site, which the parent puts on PYTHONPATH") from error

        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), load_format="dummy",
                       dtype=dtype, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, seed=0,
                       generation_config="vllm")

    def prepare(self, prompts: Sequence[list[int]] | Sequence[str], max_tokens: Sequence[int],
                temperature: float) -> tuple[list[Any], list[Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs: list[Any] = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p))
                             for p in prompts]
        params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n,
                                 detokenize=False) for n in max_tokens]
        return inputs, params

    def run(self, prepared: object) -> RunCounts:
        inputs, params = prepared  # type: ignore[misc]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        cached = [o.num_cached_tokens for o in outs]
        return RunCounts(len(outs), sum(len(o.prompt_token_ids or ()) for o in outs),
                         sum(len(o.outputs[0].token_ids) for o in outs),
                         None if None in cached else sum(cached))

    def reset_cache(self) -> bool:
        return self.llm.reset_prefix_cache()

    def info(self) -> dict[str, Any]:
        import vllm

        config = self.llm.llm_engine.vllm_config
        return {"vllm": vllm.__version__, "dtype": str(config.model_config.dtype),
                "max_model_len": config.model_config.max_model_len,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "block_size": config.cache_config.block_size,
                "num_gpu_blocks": config.cache_config.num_gpu_blocks,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching}

    def close(self) -> None:
        del self.llm
        gc.collect()


# ---- measuring (child) --------------------------------------------------------------------------
def process_age_seconds() -> float:
    """Seconds since this process started (Linux /proc; else since this module was imported)."""
    since_import = time.perf_counter() - _MODULE_T0
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
        age = float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return since_import
    return age if since_import - 0.1 <= age < since_import + 600 else since_import  # sane clock


def empty_cache(engine: Engine, timeout: float = 10.0) -> None:
    """Empties the engine's prefix cache, retrying while the engine still winds down the last
    call (a finished request's blocks can be released just after its output arrives)."""
    deadline = time.monotonic() + timeout
    while not engine.reset_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine refused to empty its prefix cache for {timeout} s")
        time.sleep(0.05)


def _timed(engine: Engine, prepared: object) -> tuple[float, RunCounts]:
    empty_cache(engine)  # every run starts with an empty prefix cache
    start = time.perf_counter()
    counts = engine.run(prepared)
    return time.perf_counter() - start, counts


Profiler = Callable[[Callable[[], object]], dict[str, Any]]


def measure_requests(engine: Engine, work: Requests, repeats: int,
                     profiler: Profiler | None = None) -> dict[str, Any]:
    """One warm-up run, then `repeats` timed runs: median seconds, output tokens/s."""
    prepared = engine.prepare(work.prompts, work.max_tokens, work.temperature)
    _timed(engine, prepared)
    runs = [_timed(engine, prepared) for _ in range(repeats)]
    seconds = statistics.median(s for s, _ in runs)
    counts = runs[-1][1]
    result: dict[str, Any] = {
        "kind": "requests", "label": work.label, "digest": work.digest(),
        "seconds": seconds, "runs_seconds": [s for s, _ in runs],
        "tokens_per_s": counts.output_tokens / seconds if seconds else None,
        "expected_output_tokens": sum(work.max_tokens), **asdict(counts)}
    if profiler is not None:
        empty_cache(engine)
        result["profile"] = profiler(lambda: engine.run(prepared))
    return result


def measure_decode(engine: Engine, work: DecodeSteps, repeats: int,
                   profiler: Profiler | None = None) -> dict[str, Any]:
    """ms per decode step: the median times of `first` and `first + steps` output tokens (runs
    of the two lengths interleaved, one warm-up run of each first)."""
    batch = len(work.prompts)
    short = engine.prepare(work.prompts, [work.first] * batch, 0.0)
    long = engine.prepare(work.prompts, [work.first + work.steps] * batch, 0.0)
    _timed(engine, short)
    _timed(engine, long)
    first, whole, counts = [], [], None
    for _ in range(repeats):
        first.append(_timed(engine, short)[0])
        seconds, counts = _timed(engine, long)
        whole.append(seconds)
    step = (statistics.median(whole) - statistics.median(first)) / work.steps
    assert counts is not None
    result: dict[str, Any] = {
        "kind": "decode", "label": work.label, "digest": work.digest(), "batch": batch,
        "first": work.first, "steps": work.steps, "step_ms": 1e3 * step,
        "tokens_per_s": batch / step if step > 0 else None,
        "first_seconds": first, "whole_seconds": whole,
        "expected_output_tokens": batch * (work.first + work.steps), **asdict(counts)}
    if profiler is not None:
        empty_cache(engine)
        result["profile"] = profiler(lambda: engine.run(long))
    return result


def kernel_profiler(engine: Engine, top: int = 30) -> Profiler:
    """Runs a call under torch.profiler: device kernel time by category (bench/kernel_profile).
    vLLM's engine core runs in this process when profiled (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
    CUPTI sees its kernels; its forward passes are not counted (0)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.kernel_profile import device_events, summarize

    # Kernels only on a GPU (CUPTI sees every thread's); on a CPU the ops are all there is.
    activities = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
    passes = engine.forward_passes if isinstance(engine, LmnbEngine) else (lambda: 0)

    def run(call: Callable[[], object]) -> dict[str, Any]:
        before = passes()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            call()
            wall = time.perf_counter() - start
        summary = summarize(device_events(prof), wall_seconds=wall,
                            passes=passes() - before, top=top)
        return summary

    return run


def build_engine(name: str, model_dir: Path, args: argparse.Namespace) -> Engine:
    if name == "vllm":
        return VllmEngine(model_dir, dtype=args.dtype, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    return LmnbEngine(model_dir, dtype=args.dtype, device=args.device, backend=args.lmnb_backend,
                      mem_fraction=args.lmnb_mem_fraction, chunk=args.lmnb_chunk,
                      conservativeness=args.lmnb_conservativeness, policy=args.lmnb_policy)


def _versions() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "device_name": (torch.cuda.get_device_name() if
                                            torch.cuda.is_available() else "cpu")}
    for package in ("transformers", "flashinfer", "triton"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # not installed, or it fails to load here
            info[package] = None
    return info


def run_child(args: argparse.Namespace, model_dir: Path, json_out: Path | None) -> dict[str, Any]:
    """This process's engine over every workload; the result (also written to `json_out` after
    each workload, so that a crash keeps what was measured)."""
    model = args.models[0]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    result: dict[str, Any] = {"engine": args.engine, "model": model, "dtype": args.dtype,
                              "sizes": asdict(args.sizes), "repeats": args.repeats,
                              "workloads": {}}

    def save() -> None:
        if json_out is not None:
            tmp = json_out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
            tmp.replace(json_out)

    start = time.perf_counter()
    if args.profile and args.engine == "vllm":  # its engine core in this process, for CUPTI
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = build_engine(args.engine, model_dir, args)
    result["start"] = {"seconds": process_age_seconds(),
                       "init_seconds": time.perf_counter() - start}
    result["info"] = engine.info()
    print(f"[{args.engine}] {model}: engine ready {result['start']['seconds']:.1f} s after the "
          f"process started ({result['start']['init_seconds']:.1f} s in its constructor)",
          flush=True)
    save()
    profiler = kernel_profiler(engine) if args.profile else None
    try:
        for name in args.workloads:
            work = make_workload(name, args.sizes, vocab)
            began = time.perf_counter()
            try:
                if isinstance(work, Requests):
                    cell = measure_requests(engine, work, args.repeats, profiler)
                else:
                    cell = measure_decode(engine, work, args.repeats, profiler)
            except Exception as error:  # one workload failing must not lose the others
                traceback.print_exc()
                cell = {"label": work.label, "digest": work.digest(), "error": repr(error)}
            cell["wall_seconds"] = time.perf_counter() - began
            result["workloads"][name] = cell
            print(f"[{args.engine}] {model}: {work.label}: {_cell_summary(cell)}", flush=True)
            save()
    finally:
        engine.close()
    result["environment"] = _versions()
    save()
    return result


def _cell_summary(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return f"FAILED {cell['error']}"
    if cell["kind"] == "decode":
        return f"{cell['step_ms']:.2f} ms/step"
    return (f"{cell['seconds']:.3f} s, {cell['tokens_per_s']:,.0f} output tok/s"
            + (f", {cell['cached_tokens']:,} cached prompt tokens"
               if cell.get("cached_tokens") is not None else ""))


# ---- comparing (parent) -------------------------------------------------------------------------
TABLE_HEADERS = ["workload", "model", "unit", "vLLM", "lmnb", "vLLM tok/s", "lmnb tok/s",
                 "lmnb/vLLM"]


def cell_value(cell: dict[str, Any] | None) -> tuple[str, float | None, float | None]:
    """(unit, time: seconds or ms per step, output tokens/s) of a child's workload cell."""
    if not cell or "error" in cell:
        return ("-", None, None)
    if cell.get("kind") == "decode":
        return ("ms/step", cell["step_ms"], cell.get("tokens_per_s"))
    return ("s", cell["seconds"], cell.get("tokens_per_s"))


def speed_ratio(vllm_time: float | None, lmnb_time: float | None) -> float | None:
    """vLLM's time over lmnb's: > 1 when lmnb is faster."""
    if vllm_time is None or lmnb_time is None or lmnb_time <= 0 or vllm_time <= 0:
        return None
    return vllm_time / lmnb_time


def mismatches(vllm_cell: dict[str, Any] | None, lmnb_cell: dict[str, Any] | None) -> list[str]:
    """Why the two engines did not do the same work (empty when they did, or when one is
    missing or failed)."""
    if not vllm_cell or not lmnb_cell or "error" in vllm_cell or "error" in lmnb_cell:
        return []
    problems = []
    if vllm_cell.get("digest") != lmnb_cell.get("digest"):
        problems.append("different prompts (workload digests differ)")
    for key in ("prompt_tokens", "output_tokens"):
        if vllm_cell.get(key) != lmnb_cell.get(key):
            problems.append(f"{key}: vLLM {vllm_cell.get(key)}, lmnb {lmnb_cell.get(key)}")
    for engine, cell in (("vLLM", vllm_cell), ("lmnb", lmnb_cell)):
        if cell.get("output_tokens") != cell.get("expected_output_tokens"):
            problems.append(f"{engine} produced {cell.get('output_tokens')} of "
                            f"{cell.get('expected_output_tokens')} output tokens")
    return problems


def _ratio_cell(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio:.2f}x"


def _time_cell(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def _rate_cell(value: float | None) -> int | None:
    return None if value is None else round(value)


def comparison_rows(model: str, runs: dict[str, dict[str, Any]],
                    workloads: Sequence[str]) -> tuple[list[list[Any]], list[str]]:
    """Table rows for one model (`runs`: engine -> child result, either may be missing) and
    the warnings (mismatched work, failures)."""
    vllm, lmnb = runs.get("vllm") or {}, runs.get("lmnb") or {}
    rows: list[list[Any]] = []
    notes: list[str] = []
    v_start, l_start = vllm.get("start", {}).get("seconds"), lmnb.get("start", {}).get("seconds")
    if vllm or lmnb:
        rows.append(["engine start", model, "s", _time_cell(v_start), _time_cell(l_start),
                     None, None, _ratio_cell(speed_ratio(v_start, l_start))])
    for name in workloads:
        v_cell = vllm.get("workloads", {}).get(name)
        l_cell = lmnb.get("workloads", {}).get(name)
        if v_cell is None and l_cell is None:
            continue
        unit, v_time, v_rate = cell_value(v_cell)
        l_unit, l_time, l_rate = cell_value(l_cell)
        label = (v_cell or l_cell or {}).get("label", name)
        problems = mismatches(v_cell, l_cell)
        for engine, cell in (("vLLM", v_cell), ("lmnb", l_cell)):
            if cell and "error" in cell:
                problems.append(f"{engine} failed: {cell['error']}")
        if problems:
            notes.append(f"{model} {label}: " + "; ".join(problems))
            label += " (!)"
        rows.append([label, model, unit if unit != "-" else l_unit, _time_cell(v_time),
                     _time_cell(l_time), _rate_cell(v_rate), _rate_cell(l_rate),
                     _ratio_cell(speed_ratio(v_time, l_time))])
    for engine, run in (("vLLM", vllm), ("lmnb", lmnb)):
        if run.get("child_error"):
            notes.append(f"{model} {engine}: {run['child_error']}")
    return rows, notes


# ---- parent: model folders and child processes --------------------------------------------------
def prepare_model(name: str, root: Path, tokenizer_dir: Path) -> Path:
    """`root/name/`: the architecture's config.json and the tokenizer's files."""
    from bench.dummy_models import write_self_contained_dummy_model

    return write_self_contained_dummy_model(name, root, tokenizer_dir).path


def tokenizer_size(tokenizer_dir: Path) -> int:
    from lmnb.runtime.models import loader

    return len(loader.load_tokenizer(tokenizer_dir))


def model_workloads(model: str, requested: Sequence[str] | None, vocab_size: int,
                    tokenizer_vocab: int) -> tuple[list[str], list[str]]:
    """(workloads to run on `model`, notes on those left out): --workloads or the model's
    default; text prompts need every tokenizer id to be a row of the model's embedding."""
    names = list(requested if requested is not None else MODEL_WORKLOADS.get(model, WORKLOADS))
    notes = []
    if "prefix-text" in names and tokenizer_vocab > vocab_size:
        names.remove("prefix-text")
        notes.append(f"{model}: prefix-text skipped (tokenizer has {tokenizer_vocab} ids, the "
                     f"model's vocabulary {vocab_size})")
    return names, notes


def child_env(vllm_site: Path | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The children's environment: the repo (and vLLM's site folder, when there) on PYTHONPATH,
    vLLM's switches, no model hub."""
    env = dict(os.environ if base is None else base)
    paths = [str(REPO_ROOT)]
    if vllm_site is not None and vllm_site.is_dir():
        paths.append(str(vllm_site))
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(VLLM_ENV)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


# Where each engine keeps its compiled kernels between processes (empty: a fresh machine's start)
COMPILE_CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT",
                           "FLASHINFER_WORKSPACE_BASE")


def cold_cache_env(env: dict[str, str], root: Path) -> dict[str, str]:
    """`env` with every compile cache in a new empty folder under `root`."""
    folders = {name: root / name.lower() for name in COMPILE_CACHE_VARIABLES}
    for folder in folders.values():
        folder.mkdir(parents=True)
    return {**env, **{name: str(folder) for name, folder in folders.items()}}


def child_command(engine: str, model: str, model_dir: Path, workloads: Sequence[str],
                  json_out: Path, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--engine", engine,
               "--models", model, "--model-dir", str(model_dir),
               "--workloads", ",".join(workloads) if workloads else "none",
               "--json-out", str(json_out), "--repeats", str(args.repeats),
               "--max-model-len", str(args.max_model_len),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--device", args.device]
    if args.dtype_override is not None:
        command += ["--dtype", args.dtype_override]
    if args.tiny:
        command.append("--tiny")
    if engine == "lmnb":
        if args.lmnb_backend is not None:
            command += ["--lmnb-backend", args.lmnb_backend]
        if args.lmnb_mem_fraction is not None:
            command += ["--lmnb-mem-fraction", str(args.lmnb_mem_fraction)]
        if args.lmnb_chunk is not None:
            command += ["--lmnb-chunk", str(args.lmnb_chunk)]
        command += ["--lmnb-conservativeness", str(args.lmnb_conservativeness),
                    "--lmnb-policy", args.lmnb_policy]
    if args.profile:
        command.append("--profile")
    return command


def _wait_group_gone(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Waits until every process of the child's group (vLLM's engine core among them) is gone,
    then terminates what is left after `timeout`, so that the next engine finds the GPU free."""
    deadline = time.monotonic() + timeout
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            proc.poll()  # reap the child itself: a zombie still counts as a member
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def run_engine_process(command: list[str], env: dict[str, str], json_out: Path,
                       timeout: float) -> dict[str, Any]:
    """Runs one child to its end (output streamed through); its result, with `child_error` when
    it failed (what it measured before failing is kept)."""
    print("$ " + " ".join(command), flush=True)
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    error = None
    try:
        code = proc.wait(timeout=timeout)
        if code != 0:
            error = f"exited with {code}"
    except subprocess.TimeoutExpired:
        error = f"killed after {timeout:.0f} s"
    finally:  # an exited child's engine core gets 30 s to follow it; else the group is ended
        _wait_group_gone(proc, 30.0 if proc.returncode is not None else 0.0)
        proc.wait()
    result = json.loads(json_out.read_text()) if json_out.is_file() else {}
    if error:
        result["child_error"] = error
    return result


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer_dir = Path(args.tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file() and not (
            tokenizer_dir / "tokenizer.model").is_file():
        raise SystemExit(f"no tokenizer in {tokenizer_dir}: run bench/fetch_tokenizers.sh here "
                         "(the Llama-3 tokenizer into .gpu/tokenizer-llama3) or pass "
                         "--tokenizer-dir")
    engines = ["lmnb"] if args.skip_vllm else list(ENGINES)
    env = child_env(args.vllm_site)
    tok_vocab = tokenizer_size(tokenizer_dir)
    payload: dict[str, Any] = {
        "benchmark": "vs_vllm", "engines": engines, "models": {}, "notes": [],
        "config": {"repeats": args.repeats, "tiny": args.tiny, "sizes": asdict(args.sizes),
                   "tokenizer_dir": str(tokenizer_dir), "tokenizer_vocab": tok_vocab,
                   "lmnb_backend": args.lmnb_backend, "max_model_len": args.max_model_len,
                   "gpu_memory_utilization": args.gpu_memory_utilization,
                   "lmnb_mem_fraction": args.lmnb_mem_fraction, "lmnb_chunk": args.lmnb_chunk,
                   "lmnb_conservativeness": args.lmnb_conservativeness,
                   "lmnb_policy": args.lmnb_policy,
                   "profile": args.profile, "cold_caches": args.cold_caches},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": _git_commit()}
    with tempfile.TemporaryDirectory(prefix="lmnb-vs-vllm-") as scratch:
        for model in args.models:
            model_dir = prepare_model(model, Path(scratch), tokenizer_dir)
            vocab = DUMMY_CONFIGS[model]["vocab_size"]
            workloads, notes = model_workloads(model, args.workloads, vocab, tok_vocab)
            payload["notes"] += notes
            runs: dict[str, Any] = {}
            payload["models"][model] = {"workloads": workloads, "runs": runs}
            for engine in engines:
                json_out = Path(scratch) / f"{model}-{engine}.json"
                command = child_command(engine, model, model_dir, workloads, json_out, args)
                engine_env = (cold_cache_env(env, Path(scratch) / f"{model}-{engine}-caches")
                              if args.cold_caches else env)
                runs[engine] = run_engine_process(command, engine_env, json_out,
                                                  args.child_timeout)
                write_results(args.output, payload)
    print_report(payload)
    path = write_results(args.output, payload)
    print(f"wrote {path}" + (f" (and {os.environ['OUT']})" if os.environ.get("OUT") else ""))
    return payload


def print_report(payload: dict[str, Any]) -> None:
    rows, notes = [], list(payload.get("notes", []))
    for model, entry in payload["models"].items():
        model_rows, model_notes = comparison_rows(model, entry["runs"], entry["workloads"])
        rows += model_rows
        notes += model_notes
    payload["table"] = {"headers": TABLE_HEADERS, "rows": rows}
    devices = {run.get("environment", {}).get("device_name")
               for entry in payload["models"].values() for run in entry["runs"].values()}
    print(f"\nlmnb vs vLLM ({', '.join(sorted(d for d in devices if d)) or 'no device'}; "
          f"median of {payload['config']['repeats']} after a warm-up; lmnb/vLLM = vLLM time / "
          "lmnb time, > 1: lmnb faster)")
    print(format_table(TABLE_HEADERS, rows))
    print()
    print(format_markdown_table(TABLE_HEADERS, rows))
    for note in notes:
        print(f"note: {note}")
    for model, entry in payload["models"].items():
        for engine, run in entry["runs"].items():
            for cell in run.get("workloads", {}).values():
                if "profile" in cell:
                    print_profile(f"{engine} {model} {cell['label']}", cell["profile"])


def print_profile(title: str, summary: dict[str, Any],
                  run: str = "one extra profiled run, not timed") -> None:
    from bench.kernel_profile import CATEGORY_HEADERS, category_rows

    print(f"\nkernel time by category, {title}: {summary['passes']} passes, wall "
          f"{1e3 * summary['wall_seconds']:.1f} ms, device busy {1e3 * summary['busy_seconds']:.1f}"
          f" ms ({run})")
    print(format_table(CATEGORY_HEADERS, category_rows(summary)))
    others = [k for k in summary["top_kernels"] if k["category"] == "other"]
    if others:
        print("  'other': " + "; ".join(f"{k['name'][:50]} {1e3 * k['seconds']:.1f} ms"
                                        for k in others))
    gaps = summary.get("idle_gaps")
    if gaps:
        print(f"  first kernel at {1e3 * summary.get('first_kernel_seconds', 0):.1f} ms, span of "
              f"kernels {1e3 * summary['span_seconds']:.1f} ms; idle by gap length: "
              + ", ".join(f"{k} {v:.1f} ms ({gaps['count_by_length'][k]})"
                          for k, v in gaps["ms_by_length"].items()))
        print("  longest: " + "; ".join(f"{g['ms']:.1f} ms at {g['at_ms']:.0f} "
                                        f"({g['after'][:28]} -> {g['before'][:28]})"
                                        for g in gaps["longest"][:8]))
        print("  by pair: " + "; ".join(f"{pair} {ms:.1f} ms" for pair, ms in gaps["top_pairs"]))
    if not summary["kernel_seconds"]:
        print("  (no device events: on a CPU the profiler does not see the ops of lmnb's "
              "scheduler thread; CUDA kernels are recorded from every thread)")




def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


# ---- arguments ----------------------------------------------------------------------------------
def _names(text: str, known: Sequence[str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"{flag}: unknown {', '.join(unknown)} "
                                         f"(known: {', '.join(known)})")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{flag}: a name is repeated")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None,
                        help=f"comma list of bench/dummy_models.py architectures (default "
                             f"{','.join(DEFAULT_MODELS)}; --tiny: {TINY_MODEL})")
    parser.add_argument("--workloads", default=None,
                        help=f"comma list of {', '.join(WORKLOADS)}, or all (default: all; "
                             "offline only on llama-2-7b); 'start' is always measured")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per workload")
    parser.add_argument("--skip-vllm", action="store_true", help="run lmnb only")
    parser.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER_DIR,
                        help="HF tokenizer folder copied into the model folders (default "
                             ".gpu/tokenizer-llama3, see bench/fetch_tokenizers.sh)")
    parser.add_argument("--lmnb-backend", default=None,
                        help="lmnb attention backend (triton, flashinfer, ...; default: lmnb's)")
    parser.add_argument("--lmnb-mem-fraction", type=float, default=None,
                        help="lmnb mem_fraction_static (default: lmnb's sizing)")
    parser.add_argument("--lmnb-chunk", type=int, default=None,
                        help="lmnb chunked_prefill_size (default: lmnb's)")
    parser.add_argument("--lmnb-conservativeness", type=float, default=1.0,
                        help="lmnb schedule_conservativeness")
    parser.add_argument("--lmnb-policy", default="lpm", help="lmnb schedule_policy")
    parser.add_argument("--max-model-len", type=int, default=4096, help="vLLM max_model_len")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="vLLM gpu_memory_utilization")
    parser.add_argument("--dtype", dest="dtype_override", default=None,
                        help="default: the architecture's (bf16 Llama-3-8B, fp16 Llama-2-7B)")
    parser.add_argument("--device", default="auto", help="lmnb's device (vLLM: its own)")
    parser.add_argument("--cold-caches", action="store_true",
                        help="each engine's process starts with empty compile caches (Triton, "
                             "TorchInductor, vLLM, FlashInfer): a fresh machine's start")
    parser.add_argument("--profile", action="store_true",
                        help="after each lmnb workload's timed runs, one more run under "
                             "torch.profiler: kernel time by category")
    parser.add_argument("--tiny", action="store_true",
                        help=f"CPU check: the {TINY_MODEL} architecture and small workloads")
    parser.add_argument("--vllm-site", type=Path, default=DEFAULT_VLLM_SITE,
                        help="folder vLLM was installed into (put on the children's "
                             "PYTHONPATH when it exists; default /tmp/vllm-site)")
    parser.add_argument("--child-timeout", type=float, default=3600.0,
                        help="seconds one engine's process may run")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "vs_vllm.json")
    child = parser.add_argument_group("one engine in this process (what the parent runs)")
    child.add_argument("--engine", choices=ENGINES, default=None)
    child.add_argument("--model-dir", type=Path, default=None,
                       help="the model folder the parent prepared (default: made here)")
    child.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        args.models = _names(args.models, sorted(DUMMY_CONFIGS), "--models") if args.models \
            else [TINY_MODEL] if args.tiny else list(DEFAULT_MODELS)
        if args.workloads in (None, "all"):
            args.workloads = None if args.workloads is None else list(WORKLOADS)
        elif args.workloads == "none":
            args.workloads = []
        else:
            args.workloads = _names(args.workloads, WORKLOADS, "--workloads")
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not args.models:
        parser.error("--models: at least one")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.max_model_len < 1:
        parser.error("--max-model-len must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if args.lmnb_mem_fraction is not None and not 0 < args.lmnb_mem_fraction <= 1:
        parser.error("--lmnb-mem-fraction must be in (0, 1]")
    if args.child_timeout <= 0:
        parser.error("--child-timeout must be > 0")
    if args.engine is None:
        if args.model_dir is not None or args.json_out is not None:
            parser.error("--model-dir and --json-out go with --engine")
    else:
        if args.skip_vllm:
            parser.error("--skip-vllm goes with the parent (no --engine)")
        if len(args.models) != 1:
            parser.error("--engine runs one model: give --models NAME")
    args.sizes = TINY if args.tiny else FULL
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.engine is None:
        return run_parent(args)
    model = args.models[0]
    workloads = list(args.workloads if args.workloads is not None
                     else MODEL_WORKLOADS.get(model, WORKLOADS))
    args.dtype = args.dtype_override or DUMMY_CONFIGS[model]["dtype"]
    with tempfile.TemporaryDirectory(prefix="lmnb-vs-vllm-") as scratch:
        model_dir = args.model_dir
        if model_dir is None:  # run alone: this process prepares the folder
            model_dir = prepare_model(model, Path(scratch), args.tokenizer_dir)
            vocab = DUMMY_CONFIGS[model]["vocab_size"]
            workloads, notes = model_workloads(model, workloads, vocab,
                                               tokenizer_size(args.tokenizer_dir))
            for note in notes:
                print(f"note: {note}")
        args.workloads = workloads
        result = run_child(args, model_dir, args.json_out)
    if args.json_out is None:  # run alone: its own one-engine table
        rows, notes = comparison_rows(model, {args.engine: result}, workloads)
        print(format_table(TABLE_HEADERS, rows))
        for note in notes:
            print(f"note: {note}")
        for cell in result["workloads"].values():
            if "profile" in cell:
                print_profile(f"{model} {cell['label']}", cell["profile"])
    return result


if __name__ == "__main__":  # vLLM's engine core is a subprocess that re-imports this module
    main()
