"""The SGLang paper's benchmark shapes as DSL programs, radix cache on vs off, and a fork-heavy
program beside the same requests sent raw.

No benchmark data set ships offline (DESIGN.md, "Models, tokenizers and data offline"), so the
text is synthetic: seeded English-like sentences from `programs.WORDS`, at the lengths of the
real sets (the JSON reports the token counts):

- mmlu: 5-shot multiple choice as in MMLU's harness: per subject a header and 5 solved examples
  (a ~45-word stem, 4 options of ~6 words, "Answer: X"; ~550 tokens shared), then the question;
  one `gen` of 1 token (the answer letter). `subjects` x `questions` programs.
- hellaswag: 20-shot as SGLang's HellaSwag benchmark: 20 solved contexts (~1,700 tokens shared by
  every item), then the item's context and a `select` among 4 endings of ~20 words.
- fork: branch-solve-merge over documents: each program reads a ~900-word document, forks into 4
  questions (a 16-token answer each), joins them (`concat_and_append`) and writes a 24-token
  summary. Beside the DSL run, the same requests go raw to `Runtime.generate` (the fork prompts
  in one call, then the merge prompts in another): the DSL's throughput over the raw one.

Each gen produces exactly its `max_tokens` (`min_tokens` equal), so both cache modes decode the
same tokens. The two runtimes (same model, one with `disable_radix_cache=True`) are loaded once;
the modes alternate which runs first.

    python bench/program_suites.py --scale 0.1                    # CPU, embedded SmolLM2
    python bench/program_suites.py --dummy-config llama-3-8b --tokenizer .gpu/tokenizer \\
        --device cuda                                             # H100: under 4 minutes
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmnb  # noqa: E402
from bench.common import RESULTS_DIR, environment, format_table, stopwatch, write_json  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from bench.programs import (  # noqa: E402
    SEED,
    WORDS,
    RecordingRuntime,
    Request,
    check_states,
    fixed_gen,
    optimal_computed_tokens,
)
from bench.request_timeline import RequestTimeline  # noqa: E402
from lmnb.lang.program import ProgramState  # noqa: E402

FORK_TOKENS = 16  # per forked answer
MERGE_TOKENS = 24  # the merged summary: a different length tells the two kinds of request apart
QUESTIONS_PER_DOCUMENT = 4


# ---- synthetic text ----------------------------------------------------------------------------
def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _sentence(rng: random.Random, low: int, high: int, end: str = ".") -> str:
    text = _words(rng, low, high)
    return text[0].upper() + text[1:] + end


def _paragraph(rng: random.Random, words: int) -> str:
    sentences = []
    while words > 0:
        length = min(words, rng.randint(10, 22))
        sentences.append(_sentence(rng, length, length))
        words -= length
    return " ".join(sentences)


def _mc_question(rng: random.Random) -> str:
    stem = _paragraph(rng, rng.randint(35, 55))[:-1] + "?"
    options = "\n".join(f"{letter}. {_words(rng, 4, 8)}" for letter in "ABCD")
    return f"{stem}\n{options}\nAnswer:"


def _count(base: int, scale: float) -> int:
    return max(1, round(base * scale))


# ---- programs ----------------------------------------------------------------------------------
@lmnb.function
def mmlu_5shot(s: ProgramState, examples: str, question: str) -> None:
    s += examples + question + fixed_gen("answer", 1)


@lmnb.function
def hellaswag_20shot(s: ProgramState, examples: str, context: str, endings: list[str]) -> None:
    s += examples + context
    s += lmnb.select("ending", choices=endings)


@lmnb.function
def document_qa(s: ProgramState, document: str, questions: list[str]) -> None:
    s += "Read the document, answer each question, then summarize.\n\n" + document + "\n\n"
    forks = s.fork(len(questions))
    forks += lambda i: (f"Question {i + 1}: {questions[i]}\nAnswer:"
                        + fixed_gen("answer", FORK_TOKENS))
    s.join(forks, mode="concat_and_append")
    s += "\nSummary of the answers:" + fixed_gen("summary", MERGE_TOKENS)


# ---- suites: data, then a job that runs the programs and returns how many ---------------------
Job = Callable[[Any], int]


@dataclass(frozen=True)
class Suite:
    job: Job
    items: list[dict[str, Any]]


def mmlu(rng: random.Random, scale: float) -> Suite:
    items = []
    for _ in range(_count(8, scale)):
        subject = _words(rng, 2, 2)
        examples = (f"The following are multiple choice questions (with answers) about "
                    f"{subject}.\n\n"
                    + "".join(f"{_mc_question(rng)} {rng.choice('ABCD')}\n\n" for _ in range(5)))
        items += [{"examples": examples, "question": _mc_question(rng)}
                  for _ in range(_count(32, min(scale, 1.0)))]
    return Suite(lambda backend: check_states(mmlu_5shot.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0)), items)


def hellaswag(rng: random.Random, scale: float) -> Suite:
    examples = "".join(f"{_paragraph(rng, rng.randint(30, 45))[:-1]}, {_words(rng, 15, 22)}.\n\n"
                       for _ in range(20))
    items = [{"context": _paragraph(rng, rng.randint(30, 45))[:-1] + ",",
              "endings": [f" {_words(rng, 15, 22)}." for _ in range(4)]}
             for _ in range(_count(64, scale))]
    program = hellaswag_20shot.bind(examples=examples)  # SGLang's benchmark binds the shots too
    return Suite(lambda backend: check_states(program.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0)), items)


def fork(rng: random.Random, scale: float) -> Suite:
    items = [{"document": "\n\n".join(_paragraph(rng, 150) for _ in range(6)),
              "questions": [_sentence(rng, 8, 14, "?") for _ in range(QUESTIONS_PER_DOCUMENT)]}
             for _ in range(_count(64, scale))]
    return Suite(lambda backend: check_states(document_qa.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0)), items)


SUITES: dict[str, Callable[[random.Random, float], Suite]] = {
    "mmlu": mmlu, "hellaswag": hellaswag, "fork": fork}


# ---- measuring -----------------------------------------------------------------------------------
def _token_counts(requests: Sequence[Request]) -> dict[str, Any]:
    prompt = sum(r.meta_info["prompt_tokens"] for r in requests)
    cached = sum(r.meta_info["cached_tokens"] for r in requests)
    optimal = optimal_computed_tokens(requests)
    return {"requests": len(requests), "prompt_tokens": prompt,
            "output_tokens": sum(r.meta_info["completion_tokens"] for r in requests),
            "computed_prompt_tokens": prompt - cached, "hit_rate": cached / max(prompt, 1),
            "optimal_hit_rate": 1.0 - optimal / max(prompt, 1)}


def run_suite(runtime: Any, suite: Suite) -> tuple[dict[str, Any], list[Request]]:
    from lmnb.lang.backends.local import LocalBackend

    if not runtime.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    recorder = RecordingRuntime(runtime)
    before = runtime.stats()
    cpu = time.process_time()
    with stopwatch(runtime.device) as timing:
        programs = suite.job(LocalBackend(recorder))
    cpu = time.process_time() - cpu
    after = runtime.stats()
    seconds = timing["seconds"]
    return {"programs": programs, "seconds": seconds, "programs_per_s": programs / seconds,
            "cpu_seconds": cpu, **_token_counts(recorder.requests),
            "forward_passes": after["forward_passes"] - before["forward_passes"],
            "evicted_tokens": after["evicted_tokens"] - before["evicted_tokens"]}, \
        recorder.requests


def run_plain(runtime: Any, suite: Suite) -> dict[str, Any]:
    """The suite's programs on a plain `LocalBackend` (no recording wrapper: what users run),
    with the request timeline of `bench/request_timeline.py`."""
    from lmnb.lang.backends.local import LocalBackend

    if not runtime.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    timeline = RequestTimeline()
    runtime.set_batch_hook(timeline.batch_hook())
    try:
        with timeline.recording(), stopwatch(runtime.device) as timing:
            timeline.restart()
            programs = suite.job(LocalBackend(runtime))
    finally:
        runtime.set_batch_hook(None)
    return {"programs": programs, "seconds": timing["seconds"],
            "timeline": timeline.summary()}


def run_raw(runtime: Any, phases: list[list[Request]]) -> dict[str, Any]:
    """The DSL's gen requests sent straight to `runtime.generate`: each phase (requests that
    depend on the previous phase's outputs) as one call of its prompts' ids."""
    if not runtime.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    before = runtime.stats()
    timeline = RequestTimeline()
    runtime.set_batch_hook(timeline.batch_hook())
    try:
        with timeline.recording(), stopwatch(runtime.device) as timing:
            timeline.restart()
            for phase in phases:
                tokens = phase[0].meta_info["completion_tokens"]
                runtime.generate(input_ids=[r.input_ids for r in phase], sampling_params={
                    "max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 0.0})
    finally:
        runtime.set_batch_hook(None)
    after = runtime.stats()
    return {"requests": sum(map(len, phases)), "seconds": timing["seconds"],
            "forward_passes": after["forward_passes"] - before["forward_passes"],
            "timeline": timeline.summary()}


def fork_phases(requests: Sequence[Request]) -> list[list[Request]]:
    """The fork suite's gen requests: the forked answers, then the merged summaries."""
    by_tokens = {count: [r for r in requests if r.meta_info["completion_tokens"] == count]
                 for count in (FORK_TOKENS, MERGE_TOKENS)}
    return [by_tokens[FORK_TOKENS], by_tokens[MERGE_TOKENS]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dummy-config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="random weights of this architecture instead of --model")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for --dummy-config (default: the embedded "
                             "SmolLM2's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies program counts (mmlu: 8 subjects x 32 questions, "
                             "hellaswag: 64 items, fork: 64 documents)")
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma list of {', '.join(SUITES)}")
    parser.add_argument("--max-total-tokens", type=int, default=120_000,
                        help="KV pool size in tokens, per runtime (two runtimes: Llama-3-8B's "
                             "KV is 128 KiB a token, 15 GiB each)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per suite and mode, interleaved; the fastest counts")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "program_suites.json")
    args = parser.parse_args(argv)
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown or not args.suites:
        parser.error(f"unknown suites {unknown}; available: {', '.join(SUITES)}")
    if args.scale <= 0 or args.repeats < 1:
        parser.error("--scale must be > 0 and --repeats >= 1")
    if args.dummy_config and args.model:
        parser.error("--model and --dummy-config exclude each other")
    return args


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {**min(runs, key=lambda r: r["seconds"]), "seconds_all": [r["seconds"] for r in runs]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from lmnb.runtime.engine import Runtime

    hf_logging.set_verbosity_error()
    options: dict[str, Any] = dict(device=args.device, max_total_tokens=args.max_total_tokens,
                                   max_running_requests=1024)
    model_label = args.model or "embedded SmolLM2-135M-Instruct"
    model_path = args.model
    with tempfile.TemporaryDirectory(prefix="lmnb-suites-") as scratch:
        if args.dummy_config:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
            model_path, model_label = str(dummy.path), dummy.label
            options.update(dummy.runtime_options())
        start = time.perf_counter()
        runtimes = {"on": Runtime(model_path, **options),
                    "off": Runtime(model_path, disable_radix_cache=True, **options)}
        load_seconds = time.perf_counter() - start
    try:
        return measure_all(args, runtimes, model_label, load_seconds)
    finally:
        for runtime in runtimes.values():
            runtime.close()


def measure_all(args: argparse.Namespace, runtimes: dict[str, Any], model_label: str,
                load_seconds: float) -> dict[str, Any]:
    for runtime in runtimes.values():  # warm-up
        runtime.generate("Hello, world.", {"max_new_tokens": 4, "temperature": 0.0})
    device = runtimes["on"].device
    print(f"program suites: {', '.join(args.suites)}; scale {args.scale}; {model_label} on "
          f"{device} (2 runtimes loaded in {load_seconds:.0f} s)", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(args.suites):
        suite = SUITES[name](random.Random(SEED), args.scale)
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": [], "raw": [], "plain": []}
        for repeat in range(args.repeats):
            modes = ("on", "off") if (index + repeat) % 2 == 0 else ("off", "on")
            for mode in modes:
                result, requests = run_suite(runtimes[mode], suite)
                runs[mode].append(result)
                if name == "fork" and mode == "on":
                    runs["raw"].append(run_raw(runtimes["on"], fork_phases(requests)))
                    runs["plain"].append(run_plain(runtimes["on"], suite))
        entry = {mode: _fastest(r) for mode, r in runs.items() if r}
        entry["radix_on_over_off"] = entry["on"]["programs_per_s"] / entry["off"][
            "programs_per_s"]
        if "raw" in entry:  # the same requests: throughput is the inverse of the seconds
            # The DSL on a plain LocalBackend (as users run it); the recorded run ("on") pays
            # for the recording wrapper too.
            entry["dsl_over_raw_throughput"] = entry["raw"]["seconds"] / entry["plain"]["seconds"]
            entry["recorded_dsl_over_raw_throughput"] = (entry["raw"]["seconds"]
                                                         / entry["on"]["seconds"])
        results[name] = entry
        print(f"  {name}: on {entry['on']['seconds']:.2f} s, off {entry['off']['seconds']:.2f} s"
              + (f", plain LocalBackend {entry['plain']['seconds']:.2f} s, raw "
                 f"{entry['raw']['seconds']:.2f} s" if "raw" in entry else ""), flush=True)
        for kind in ("plain", "raw"):
            if kind in entry:
                steps = entry[kind]["timeline"]
                print(f"    {kind} timeline (first, last s): " + ", ".join(
                    f"{step} {value['first']:.3f}/{value['last']:.3f}"
                    for step, value in steps.items() if isinstance(value, dict)
                    and "first" in value) + f"; CPU s to the first pass "
                    f"{steps['thread_cpu_s_to_first_pass']}", flush=True)
    rows = []
    for name, entry in results.items():
        for mode in ("on", "off"):
            r = entry[mode]
            rows.append((name, mode, r["programs"], r["requests"], r["prompt_tokens"],
                         r["prompt_tokens"] / r["programs"], r["output_tokens"], r["seconds"],
                         r["programs_per_s"], r["hit_rate"], r["optimal_hit_rate"],
                         r["forward_passes"]))
    print(format_table(["suite", "cache", "programs", "reqs", "prompt tok", "tok/program",
                        "output tok", "seconds", "prog/s", "hit rate", "optimal", "passes"],
                       rows))
    print("radix on / off: " + ", ".join(f"{name} {entry['radix_on_over_off']:.2f}x"
                                         for name, entry in results.items())
          + " (target >= 3x for mmlu and hellaswag)")
    if "fork" in results:
        print(f"fork: DSL throughput / the same requests raw: "
              f"{results['fork']['dsl_over_raw_throughput']:.2f} (target >= 0.9; with the "
              f"recording backend: {results['fork']['recorded_dsl_over_raw_throughput']:.2f})")
    payload = {
        "benchmark": "program_suites",
        "config": {"model": model_label, "suites": args.suites, "scale": args.scale,
                   "repeats": args.repeats, "max_total_tokens": args.max_total_tokens,
                   "seed": SEED, "data": "synthetic text at the real sets' lengths",
                   "load_seconds": load_seconds},
        "results": results,
        "radix_on_over_off": {name: entry["radix_on_over_off"]
                              for name, entry in results.items()},
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
