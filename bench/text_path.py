"""Prompts sent as text versus the same prompts sent as token ids, on one Runtime.

The shared-prefix workload of the side-by-side runs with vLLM: P documents of W words (generated
deterministically, seed 0), each followed by Q questions, every prompt decoding G greedy tokens
with `ignore_eos`; all P x Q prompts go to `Runtime.generate` in one call, once as token ids
(encoded beforehand, not timed) and once as strings (the runtime tokenizes them). The cache is
flushed before every run and the two paths alternate, so both start cold; the fastest of
`--repeats` runs counts. What the text path may cost over the ids path is tokenization and
whatever delays the first submission; the target is a ratio text / ids within 1.10.

Also reported per path: the median run, the caller thread's CPU seconds, the seconds until
every request is submitted (`generate(..., stream=True)` returns then), forward passes; and the
tokenizer alone on the same prompts (one `encode` per prompt versus one batch call).
`--profile` prints a cProfile of the submit side of one more text run.

    python bench/text_path.py                                   # 8 x 1,400 words x 32, G=16
    python bench/text_path.py --prefixes 2 --words 300 --questions 16 --max-new-tokens 4
    python bench/text_path.py --dummy-config llama-3-8b --device cuda --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
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

SEED = 0
TARGET_RATIO = 1.10
_COMMON = ("the of and to in is was for on that with as by at from his an were are which this be "
           "has had not but they their one all would there been when who will more no if out so "
           "said what up its about into than them can only other new some could time these two "
           "may then do first any my now such like our over man me even most made after "
           "also").split()
_RARER = ("photosynthesis archipelago reconciliation thermodynamics bureaucratic hypothesis "
          "infrastructure metamorphosis kaleidoscope jurisprudence cartography lighthouse "
          "paleontology orchestration quarantine serendipity vulnerability sediment tectonic "
          "monastery parliament spectroscopy tributary glacier meridian equinox").split()


def _document(rng: random.Random, words: int) -> str:
    """`words` words in sentences of 6-18, mostly common words, some long rare ones."""
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(_RARER) if rng.random() < 0.15 else rng.choice(_COMMON)
                    for _ in range(min(rng.randint(6, 18), words - len(out)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += rng.choice(".,;.")
        out.extend(sentence)
    return " ".join(out)


def make_prompts(*, prefixes: int, words: int, questions: int) -> list[str]:
    """`prefixes` documents x `questions` questions, document-major (as a client sends them)."""
    rng = random.Random(SEED)
    documents = [_document(rng, words) for _ in range(prefixes)]
    return [f"Document {d + 1}:\n{doc}\n\nQuestion {q + 1}: how often does the word "
            f"'{rng.choice(_RARER)}' appear, and why? Answer:"
            for d, doc in enumerate(documents) for q in range(questions)]


def _nearly_free(scratch: Path, tokenizer: str | None) -> tuple[Path, Path]:
    """(a folder with the config.json of bench/dsl_overhead.py's nearly-free model, its
    tokenizer's folder: `tokenizer`, by default SmolLM2's)."""
    from bench.dsl_overhead import NEARLY_FREE
    from lmnb.runtime.models import loader

    tokenizer_dir = loader.resolve_model_dir(tokenizer)
    vocab = len(loader.load_tokenizer(tokenizer_dir))
    folder = scratch / "nearly-free"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**NEARLY_FREE, "vocab_size": vocab}))
    return folder, tokenizer_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--words", type=int, default=1400, help="words per shared document")
    parser.add_argument("--questions", type=int, default=32, help="prompts per document")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per path; fastest counts")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="HF folder or GGUF (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default=None,
                       help="random weights of this architecture (GPU)")
    model.add_argument("--nearly-free", action="store_true",
                       help="a 1-layer, 64-wide random Llama (bench/dsl_overhead.py's): on the "
                            "CPU, what remains is the host's work")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for --dummy-config (default: SmolLM2's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the caller thread of one more text run")
    parser.add_argument("--top", type=int, default=25, help="rows of the profile table")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "text_path.json")
    args = parser.parse_args(argv)
    for name in ("prefixes", "words", "questions", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokenizer is not None and args.dummy_config is None and not args.nearly_free:
        parser.error("--tokenizer goes with --dummy-config or --nearly-free (a --model folder "
                     "has its own)")
    return args


@dataclass(frozen=True)
class Run:
    seconds: float  # the whole generate call, on a flushed cache
    caller_cpu_seconds: float  # CPU time of the calling thread during it
    submit_seconds: float  # generate(stream=True) until it returns: every request submitted
    forward_passes: int


def _run(rt: Any, device: Any, request: dict[str, Any]) -> Run:
    """One measured `generate` on a flushed cache, then the same with `stream=True` timed until
    it returns (all requests submitted; the stream is drained untimed)."""
    if not rt.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    passes = rt.stats()["forward_passes"]
    cpu = time.thread_time()
    with stopwatch(device) as run:
        outputs = rt.generate(**request)
    cpu = time.thread_time() - cpu
    passes = rt.stats()["forward_passes"] - passes
    if not all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outputs):
        raise RuntimeError("a request ended early (ignore_eos is set)")
    rt.flush_cache()
    start = time.perf_counter()
    stream = rt.generate(**request, stream=True)
    submit = time.perf_counter() - start
    for _ in stream:
        pass
    return Run(run["seconds"], cpu, submit, passes)


def _tokenizer_alone(tokenizer: Any, prompts: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    for text in prompts:
        tokenizer.encode(text, add_special_tokens=True)
    one_by_one = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer(prompts, add_special_tokens=True)
    batch = time.perf_counter() - start
    return {"encode_one_by_one_s": one_by_one, "encode_batch_s": batch}


def _submit_profile(rt: Any, prompts: list[str], params: dict[str, Any], top: int) -> str:
    """cProfile (wall clock) of `generate(prompts, stream=True)` until every request is
    submitted, the rows of lmnb's request building and the tokenizer (from Python 3.12 cProfile
    sees every thread; the scheduler's rows are left out)."""
    rt.flush_cache()
    profile = cProfile.Profile()
    stream = profile.runcall(rt.generate, prompts, params, stream=True)
    for _ in stream:
        pass
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(r"engine.py|prompts.py|media_requests|params.py|processor.py|stream.py|"
                      r"loop.py|tokeniz", top)
    return out.getvalue()


def run(args: argparse.Namespace, rt: Any, device: Any) -> dict[str, Any]:
    prompts = make_prompts(prefixes=args.prefixes, words=args.words, questions=args.questions)
    ids = [rt.encode(text) for text in prompts]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    rt.generate(prompts[0][:64], {**params, "max_new_tokens": 2})  # warm-up
    paths = {"ids": {"input_ids": ids, "sampling_params": params},
             "text": {"prompt": prompts, "sampling_params": params}}
    runs: dict[str, list[Run]] = {name: [] for name in paths}
    for repeat in range(args.repeats):
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for name in order:
            runs[name].append(_run(rt, device, paths[name]))
    best = {name: min(times, key=lambda r: r.seconds) for name, times in runs.items()}
    result: dict[str, Any] = {
        "prompts": len(prompts),
        "prompt_tokens_mean": sum(map(len, ids)) / len(ids),
        "max_new_tokens": args.max_new_tokens,
        **{f"{name}_seconds": best[name].seconds for name in paths},
        **{f"{name}_median_seconds": statistics.median(r.seconds for r in runs[name])
           for name in paths},
        **{f"{name}_caller_cpu_seconds": best[name].caller_cpu_seconds for name in paths},
        **{f"{name}_submit_seconds": statistics.median(r.submit_seconds for r in runs[name])
           for name in paths},
        **{f"{name}_forward_passes": best[name].forward_passes for name in paths},
        "runs": {name: [asdict(r) for r in times] for name, times in runs.items()},
        "ratio_text_over_ids": best["text"].seconds / best["ids"].seconds,
        "target_ratio": TARGET_RATIO,
        **_tokenizer_alone(rt.tokenizer, prompts),
    }
    if args.profile:
        result["submit_profile"] = _submit_profile(rt, prompts, params, args.top)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from lmnb.runtime.engine import Runtime

    device = resolve_device(args.device)
    options: dict[str, Any] = {"device": device}
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    with tempfile.TemporaryDirectory(prefix="lmnb-text-path-") as scratch:
        if args.dummy_config is not None:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
            label = dummy.label
            rt = Runtime(str(dummy.path), **dummy.runtime_options(), **options)
        elif args.nearly_free:
            label = "nearly-free 1-layer random Llama"
            folder, tokenizer_dir = _nearly_free(Path(scratch), args.tokenizer)
            rt = Runtime(str(folder), tokenizer_path=str(tokenizer_dir), load_format="dummy",
                         dtype="float32", context_length=4096, **options)
        else:
            label = args.model or "embedded SmolLM2-135M-Instruct"
            rt = Runtime(args.model, **options)
    try:
        result = run(args, rt, device)
    finally:
        rt.close()
    result = {"model": label, "workload": {k: getattr(args, k) for k in (
        "prefixes", "words", "questions", "max_new_tokens", "repeats")}, **result,
        "environment": environment(device)}
    print(f"text_path: {label}, {result['prompts']} prompts ({args.prefixes} documents of "
          f"{args.words} words x {args.questions} questions, ~{result['prompt_tokens_mean']:.0f} "
          f"tokens), {args.max_new_tokens} greedy tokens each")
    print(format_table(
        ["path", "seconds", "median s", "caller cpu s", "submit s", "passes"],
        [[name, *(result[f"{name}_{key}"] for key in (
            "seconds", "median_seconds", "caller_cpu_seconds", "submit_seconds",
            "forward_passes"))] for name in ("ids", "text")]))
    print(f"tokenizer alone: one by one {result['encode_one_by_one_s']:.3f} s, batch "
          f"{result['encode_batch_s']:.3f} s")
    print(f"text / ids: {result['ratio_text_over_ids']:.3f} (target <= {TARGET_RATIO})")
    if "submit_profile" in result:
        print(result["submit_profile"])
    print(f"wrote {write_json(args.output, result)}")
    return result


if __name__ == "__main__":
    main()
