"""LM-program workloads (the SGLang paper's) with the radix cache on and off, side by side.

Each workload is a list of rounds: the prompts of a round are submitted together in one
`generate` call, and a later round may be built from earlier outputs (multi-turn chat). Text comes
from a fixed word list and a seeded `random.Random`, so every run sends the same prompts; prompts
go in as token ids, so the optimal hit rate (Theorem 3.1, `optimal_hit_rate`) is computed over
exactly the ids that were sent, with earlier rounds' prompt + output KV counted as already cached.

- few-shot: MMLU-style 5-shot, a shared instruction and 5 examples, one question per request.
- chat: multi-turn chat, each turn's prompt is the whole conversation so far plus a new message.
- self-consistency: GSM-style 2-shot, several questions, `n` samples each (temperature 0.7).
- no-reuse: prompts of distinct random text, nothing shared (the cache's overhead only).

Two runtimes of the same model: one with the radix cache (flushed before each workload), one with
`disable_radix_cache=True`. Outputs use `ignore_eos`, so both generate the same number of tokens.
The two modes alternate which runs first; `--repeats N` keeps the fastest of N interleaved runs.

    python bench/programs.py                          # embedded SmolLM2-135M on CPU
    python bench/programs.py --scale 4 --device cuda
    python bench/programs.py --workloads few-shot,no-reuse --repeats 3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    stopwatch,
    write_json,
)
from lmnb.runtime.radix.optimal import optimal_computed_tokens  # noqa: E402

SEED = 0
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education river stone garden engine winter
summer forest mountain bridge window letter music paper energy field season animal
machine light color voice island ocean desert village castle planet signal method theory model
value market table chair bottle glass cloud storm valley harbor station tower road street
""".split()

Encode = Callable[[str, bool], list[int]]
Outputs = list[dict[str, Any]]


@dataclass(frozen=True)
class Round:
    """Prompts submitted together; `params[i]` applies to `prompts[i]` (with `n` samples each)."""

    prompts: list[list[int]]
    params: list[dict[str, Any]]

    @property
    def requests(self) -> list[list[int]]:
        """One entry per request the engine runs: a prompt repeated `n` times."""
        return [p for p, sp in zip(self.prompts, self.params, strict=True)
                for _ in range(sp.get("n", 1))]


# A workload yields rounds and is sent each round's outputs (one dict per request).
Program = Generator[Round, Outputs, None]


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _sentence(rng: random.Random, low: int, high: int, end: str = ".") -> str:
    text = _words(rng, low, high)
    return text[0].upper() + text[1:] + end


def _mc_question(rng: random.Random) -> str:
    options = "\n".join(f"{letter}. {_words(rng, 3, 5)}" for letter in "ABCD")
    return f"{_sentence(rng, 18, 24, '?')}\n{options}\nAnswer:"


def few_shot(rng: random.Random, encode: Encode, scale: float) -> Program:
    """MMLU-style 5-shot: ~60 tokens per example, a shared header, one question per request."""
    subject = _words(rng, 2, 2)
    header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    shots = "".join(f"{_mc_question(rng)} {rng.choice('ABCD')}\n\n" for _ in range(5))
    prompts = [encode(header + shots + _mc_question(rng), True) for _ in range(_count(32, scale))]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    yield Round(prompts, [params] * len(prompts))


def chat(rng: random.Random, encode: Encode, scale: float) -> Program:
    """Multi-turn chat: 4 turns per session; each turn resends the conversation so far."""
    system = "<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n"

    def user(message: str) -> str:
        return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"

    sessions = _count(8, scale)
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    conversations = [encode(system + user(_sentence(rng, 25, 35)), True) for _ in range(sessions)]
    for turn in range(4):
        outputs = yield Round(conversations, [params] * sessions)
        if turn == 3:
            return
        conversations = [
            ids + out["output_ids"] + encode("<|im_end|>\n" + user(_sentence(rng, 25, 35)), False)
            for ids, out in zip(conversations, outputs, strict=True)]


def self_consistency(rng: random.Random, encode: Encode, scale: float) -> Program:
    """GSM-style 2-shot chain of thought; `n` sampled answers per question."""
    header = "Solve the problem. Think step by step, then give the answer.\n\n"
    shots = "".join(
        f"Question: {_sentence(rng, 25, 30, '?')}\nAnswer: {_sentence(rng, 30, 35)} "
        f"The answer is {rng.randint(2, 99)}.\n\n" for _ in range(2))
    prompts = [encode(f"{header}{shots}Question: {_sentence(rng, 25, 30, '?')}\nAnswer:", True)
               for _ in range(_count(4, scale))]
    params = {"max_new_tokens": 24, "temperature": 0.7, "n": 8, "seed": SEED, "ignore_eos": True}
    yield Round(prompts, [params] * len(prompts))


def no_reuse(rng: random.Random, encode: Encode, scale: float) -> Program:
    """Distinct random text per prompt, starting with distinct words: nothing to reuse."""
    count = _count(32, scale)
    firsts = [rng.choice(WORDS) + str(i) for i in range(count)]
    prompts = [encode(f"{first.capitalize()} {_words(rng, 110, 130)}.", True) for first in firsts]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    yield Round(prompts, [params] * len(prompts))


WORKLOADS: dict[str, Callable[[random.Random, Encode, float], Program]] = {
    "few-shot": few_shot,
    "chat": chat,
    "self-consistency": self_consistency,
    "no-reuse": no_reuse,
}


def _count(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def run_workload(rt: Any, name: str, scale: float) -> dict[str, Any]:
    """Runs one workload to the end on `rt`; the optimum counts earlier rounds' KV as cached."""
    tokenizer = rt.tokenizer

    def encode(text: str, first: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=first)

    program = WORKLOADS[name](random.Random(SEED), encode, scale)
    before = rt.stats()
    rounds: list[tuple[Round, Outputs]] = []
    cpu_start = time.process_time()
    with stopwatch(rt.device) as timing:
        batch = next(program)
        while True:
            outputs = rt.generate(input_ids=batch.prompts, sampling_params=batch.params)
            rounds.append((batch, outputs))
            try:
                batch = program.send(outputs)
            except StopIteration:
                break
    cpu_seconds = time.process_time() - cpu_start
    after = rt.stats()
    requests = prompt_tokens = cached_tokens = output_tokens = optimal_computed = 0
    seen: list[list[int]] = []  # prompt + output KV of finished requests, in the cache if it fits
    for batch, outputs in rounds:
        sent = batch.requests
        optimal_computed += optimal_computed_tokens(sent, cached=seen)
        for ids, out in zip(sent, outputs, strict=True):
            meta = out["meta_info"]
            prompt_tokens += meta["prompt_tokens"]
            cached_tokens += meta["cached_tokens"]
            output_tokens += meta["completion_tokens"]
            seen.append(ids + out["output_ids"][:-1])
        requests += len(sent)
    seconds = timing["seconds"]
    hit_rate = cached_tokens / max(prompt_tokens, 1)
    optimal = 1.0 - optimal_computed / max(prompt_tokens, 1)
    return {
        "rounds": len(rounds),
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "tokens_per_s": output_tokens / seconds,
        "cpu_seconds": cpu_seconds,  # this process's CPU time: less sensitive to other load
        "hit_rate": hit_rate,
        "optimal_hit_rate": optimal,
        "achieved_over_optimal": hit_rate / optimal if optimal > 0 else None,
        "computed_prompt_tokens": prompt_tokens - cached_tokens,
        "optimal_computed_tokens": optimal_computed,
        "evicted_tokens": after["evicted_tokens"] - before["evicted_tokens"],
        "retractions": after["retractions"] - before["retractions"],
        "forward_passes": after["forward_passes"] - before["forward_passes"],
    }


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "seconds_all": [r["seconds"] for r in runs],
            "cpu_seconds_min": min(r["cpu_seconds"] for r in runs)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies request counts")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--max-total-tokens", type=int, default=20000,
                        help="KV pool size in tokens, per runtime")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per workload and mode, interleaved; the fastest counts")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "programs.json")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"unknown workloads {unknown}; available: {', '.join(WORKLOADS)}")
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from lmnb.runtime.engine import Runtime

    hf_logging.set_verbosity_error()
    options = dict(device=args.device, max_total_tokens=args.max_total_tokens)
    runtimes = {"on": Runtime(args.model, **options),
                "off": Runtime(args.model, disable_radix_cache=True, **options)}
    results: dict[str, dict[str, Any]] = {}
    try:
        for rt in runtimes.values():  # warm-up
            rt.generate("Hello, world.", {"max_new_tokens": 4, "temperature": 0.0})
        device = runtimes["on"].device
        print(f"programs: {', '.join(args.workloads)}; scale {args.scale}; "
              f"{args.model or 'embedded SmolLM2-135M-Instruct'}, {device}")
        for index, name in enumerate(args.workloads):
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for repeat in range(args.repeats):
                # Alternate which mode goes first, so that drift in machine load hits both.
                modes = ("on", "off") if (index + repeat) % 2 == 0 else ("off", "on")
                for mode in modes:
                    rt = runtimes[mode]
                    if not rt.flush_cache():
                        raise RuntimeError("flush_cache refused: requests still in flight")
                    runs[mode].append(run_workload(rt, name, args.scale))
            results[name] = {mode: _fastest(runs[mode]) for mode in ("on", "off")}
    finally:
        for rt in runtimes.values():
            rt.close()

    rows = []
    for name, by_mode in results.items():
        for mode, r in by_mode.items():
            rows.append((name, mode, r["requests"], r["prompt_tokens"], r["output_tokens"],
                         r["seconds"], r["cpu_seconds_min"], r["tokens_per_s"], r["hit_rate"],
                         r["optimal_hit_rate"],
                         r["achieved_over_optimal"] if mode == "on"
                         and r["optimal_hit_rate"] >= 0.01 else None))
    print(format_table(["workload", "cache", "reqs", "prompt tok", "output tok", "seconds",
                        "cpu s", "out tok/s", "hit rate", "optimal", "hit/optimal"], rows))
    ratios = {name: r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"]
              for name, r in results.items()}
    cpu_ratios = {name: r["off"]["cpu_seconds_min"] / r["on"]["cpu_seconds_min"]
                  for name, r in results.items()}
    for name, r in results.items():
        on = r["on"]
        if on["evicted_tokens"]:
            print(f"note: {name} evicted {on['evicted_tokens']:,} cached tokens "
                  "(raise --max-total-tokens for the optimum's cache size)")
        if on["hit_rate"] > on["optimal_hit_rate"] + 1e-9:
            print(f"warning: {name} hit rate exceeds the computed optimum")
    if device.type == "cpu":
        print("CPU time cache off / on:   "
              + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in cpu_ratios.items()))
    print("throughput cache on / off: "
          + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()))

    payload = {
        "benchmark": "programs",
        "config": {
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "workloads": args.workloads,
            "scale": args.scale,
            "repeats": args.repeats,
            "max_total_tokens": args.max_total_tokens,
            "seed": SEED,
            "schedule_policy": "lpm",
        },
        "results": results,
        "ratio_on_over_off": ratios,
        "cpu_time_ratio_off_over_on": cpu_ratios,
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
