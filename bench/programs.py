"""The SGLang paper's LM programs, written in the DSL, with the radix cache on and off side by side.

Every workload is an `@lmnb.function` program run with `run_batch` on a `LocalBackend` over one of
two runtimes of the same model: one with the radix cache (flushed before each workload), one with
`disable_radix_cache=True`. Data comes from a fixed word list and a seeded `random.Random`, so every
run sends the same prompts. Each `gen` produces exactly its `max_tokens` (`min_tokens` equal), so
both modes decode the same number of tokens.

- mmlu: 5-shot multiple choice (per subject a shared instruction and 5 examples), `gen` 4 tokens.
- hellaswag: a shared 20-shot context, one context per item, `select` among 4 endings.
- tree-of-thought: a question forks into thoughts, each thought into critics' evaluations (`gen`
  then a `select` verdict); the best thought gets a final answer.
- skeleton-of-thought: a skeleton of N points, N forks expanding one point each, joined by
  concatenation, then a conclusion.
- judge: branch-solve-merge (paper Figure 2 without the image): relevance `select`, one fork per
  dimension, the judgments merged, a summary and a grade.
- chat-short / chat-long: sessions of 4 user/assistant turns (8 or 48 tokens per reply).
- self-consistency: 2-shot chain of thought, forked into sampled paths (temperature 0.7).
- no-reuse: distinct random text per program, nothing shared (the cache's overhead only).

The runtime under the backend is wrapped in `RecordingRuntime`, which records every request the
program causes (gens, select scoring, cache_prefix hints) with its token ids and `meta_info`. The
hit rate is cached / prompt tokens over those requests. The optimum (`optimal_computed_tokens`) is
Theorem 3.1's for the requests as the program issued them: every distinct prompt prefix is
computed once, except prefixes whose KV an earlier request produced by decoding (a previous turn's
reply, a skeleton before its forks), and a request always computes its last prompt token. The
optimum may order requests freely; a fork sends its branches together, so the few tokens that
siblings share past the fork point (a role header, "Expand point ") are computed by each.

The modes alternate which runs first; `--repeats N` keeps the fastest of N interleaved runs.

    python bench/programs.py                          # embedded SmolLM2-135M on CPU
    python bench/programs.py --scale 4 --device cuda
    python bench/programs.py --workloads mmlu,no-reuse --repeats 3
    python bench/programs.py --dummy-config llama-2-7b --tokenizer .gpu/tokenizer --scale 8

`--dummy-config NAME` runs random weights of a real architecture (GPU; text is meaningless, the
cache and scheduling work is real); its vocabulary grows to the tokenizer's when that is larger
(SmolLM2's 49152 ids for Llama-2-7B's 32000: +0.28 GB of weights), so that every prompt id has an
embedding.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmnb  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    stopwatch,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from lmnb.lang.ir import Expr  # noqa: E402
from lmnb.lang.program import ProgramState  # noqa: E402
from lmnb.runtime.radix.optimal import optimal_computed_tokens as prompt_only_optimum  # noqa: E402

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


# ---- recording the requests a program causes ---------------------------------------------------
@dataclass(slots=True)
class Request:
    input_ids: list[int]
    output_ids: list[int]
    meta_info: dict[str, Any]


class RecordingRuntime:
    """A `Runtime` stand-in for `LocalBackend` that records every finished request: its prompt
    ids, output ids and final `meta_info`. Text prompts are encoded here (as the runtime would)
    and sent as ids; `cache_prefix` goes through `generate`, so hints are recorded too."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    @property
    def device(self) -> Any:
        return self.runtime.device

    def encode(self, text: str) -> list[int]:
        return self.runtime.encode(text)

    def flush_cache(self) -> bool:
        return self.runtime.flush_cache()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *args: Any,
                            **options: Any) -> str:
        return self.runtime.apply_chat_template(messages, *args, **options)

    @property
    def engine_config(self) -> Any:
        return self.runtime.engine_config

    def stats(self) -> dict[str, Any]:
        return self.runtime.stats()

    def batched_submits(self) -> AbstractContextManager[None]:
        return self.runtime.batched_submits()

    def cache_prefix(self, prompt: str | None = None, *,
                     input_ids: Sequence[int] | None = None) -> int:
        out = self.generate(prompt, {"max_new_tokens": 0}, input_ids=input_ids)
        return out["meta_info"]["prompt_tokens"]

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 stream: bool = False, **options: Any) -> Any:
        if prompt is not None:
            input_ids = (self.encode(prompt) if isinstance(prompt, str)
                         else [self.encode(p) for p in prompt])
        if input_ids is None:
            raise ValueError("give prompt or input_ids")
        batch = bool(input_ids) and not isinstance(input_ids[0], int)
        lists = [list(ids) for ids in input_ids] if batch else [list(input_ids)]
        params = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                  else [sampling_params] * len(lists))
        sent = [ids for ids, p in zip(lists, params, strict=True)
                for _ in range((p or {}).get("n") or 1)]
        out = self.runtime.generate(sampling_params=sampling_params,
                                    input_ids=lists if batch else lists[0], stream=stream,
                                    **options)
        if stream:
            return self._recorded_stream(out, sent)
        for ids, result in zip(sent, out if isinstance(out, list) else [out], strict=True):
            self._record(ids, result["output_ids"], result["meta_info"])
        return out

    def _recorded_stream(self, chunks: Any, sent: list[list[int]]) -> RecordedStream:
        return RecordedStream(chunks, sent, self._record)

    def _record(self, input_ids: list[int], output_ids: list[int], meta: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(Request(input_ids, list(output_ids), meta))


class RecordedStream:
    """A runtime's `OutputStream` (`get(timeout)`, iteration, `async for`, `close()`) that
    records each request when its final chunk passes through."""

    def __init__(self, chunks: Any, sent: list[list[int]],
                 record: Callable[[list[int], list[int], dict[str, Any]], None]) -> None:
        self.chunks = chunks
        self.sent = sent
        self.record = record
        self.outputs: list[list[int]] = [[] for _ in sent]

    def _see(self, chunk: dict[str, Any]) -> dict[str, Any]:
        index = chunk.get("index", 0)
        self.outputs[index].extend(chunk["output_ids"])
        if chunk["meta_info"].get("finish_reason") is not None:
            self.record(self.sent[index], self.outputs[index], chunk["meta_info"])
        return chunk

    def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        chunk = self.chunks.get(timeout)
        return None if chunk is None else self._see(chunk)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for chunk in self.chunks:
                yield self._see(chunk)
        finally:
            self.chunks.close()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._aiter()

    async def aresults(self) -> list[dict[str, Any]]:
        return self.chunks.merge([chunk async for chunk in self])

    async def _aiter(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in self.chunks:
                yield self._see(chunk)
        finally:
            self.chunks.close()

    def close(self) -> None:
        self.chunks.close()


def optimal_computed_tokens(requests: Sequence[Request]) -> int:
    """The fewest prompt tokens the requests must compute: each distinct prompt prefix once,
    except those some request produced by decoding (its prompt + output but the last token, what
    the cache holds once it finishes); every request computes its last prompt token (the engine's
    rule, as in `lmnb.runtime.radix.optimal`)."""
    root: dict[int, dict] = {}
    nodes = 0
    ends: Counter[int] = Counter()
    for request in requests:
        node = root
        for token in request.input_ids:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                nodes += 1
            node = child
        ends[id(node)] += 1
    decoded: set[int] = set()  # trie nodes whose KV some request's decoding produced
    for request in requests:
        node, depth = root, len(request.input_ids)
        for position, token in enumerate(request.input_ids + request.output_ids[:-1], start=1):
            node = node.get(token)
            if node is None:
                break
            if position > depth:
                decoded.add(id(node))
    # A request ending on a computed node shares that computation with one other; on a decoded
    # node it pays for its last token alone.
    return nodes - len(decoded) + sum(count - (key not in decoded) for key, count in ends.items())


# ---- synthetic data ----------------------------------------------------------------------------
def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _sentence(rng: random.Random, low: int, high: int, end: str = ".") -> str:
    text = _words(rng, low, high)
    return text[0].upper() + text[1:] + end


def _mc_question(rng: random.Random) -> str:
    options = "\n".join(f"{letter}. {_words(rng, 2, 4)}" for letter in "ABCD")
    return f"{_sentence(rng, 12, 16, '?')}\n{options}\nAnswer:"


def _count(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def fixed_gen(name: str, tokens: int, **kwargs: Any) -> Expr:
    """A gen of exactly `tokens` tokens, so that both cache modes decode the same amount."""
    return lmnb.gen(name, max_tokens=tokens, min_tokens=tokens, **kwargs)


def check_states(states: Sequence[ProgramState]) -> int:
    for state in states:
        if (error := state.error()) is not None:
            raise error
    return len(states)


# ---- programs ----------------------------------------------------------------------------------
@lmnb.function
def few_shot_mmlu(s: ProgramState, examples: str, question: str) -> None:
    s += examples + question + fixed_gen("answer", 4)


@lmnb.function
def few_shot_hellaswag(s: ProgramState, examples: str, context: str,
                       endings: list[str]) -> None:
    s += examples + context
    s += lmnb.select("ending", choices=endings)


CRITICS = ("a careful mathematician", "a skeptical engineer", "a patient teacher")


@lmnb.function
def tree_of_thought(s: ProgramState, question: str, width: int, critics: int) -> None:
    s += lmnb.system("You solve problems by exploring several lines of thought.")
    s += lmnb.user(question)
    thoughts = s.fork(width)
    thoughts += lambda i: lmnb.assistant(f"Idea {i + 1}: " + fixed_gen("thought", 12))
    verdicts = []
    for thought in thoughts:  # each thought's evaluations start as soon as it is written
        thought += lmnb.user("Evaluate this idea in one sentence.")
        evaluations = thought.fork(critics)
        evaluations += lambda j: lmnb.assistant(f"As {CRITICS[j % len(CRITICS)]}: "
                                                + fixed_gen("evaluation", 6))
        evaluations += lmnb.user("Is the idea promising?")
        evaluations += lmnb.assistant(lmnb.select("verdict", choices=["yes", "no"]))
        verdicts.append(evaluations)
    scores = [sum(e["verdict"] == "yes" for e in evaluations) for evaluations in verdicts]
    best = max(range(width), key=lambda i: scores[i])
    s += lmnb.assistant(f"The most promising idea is: {thoughts[best]['thought']}")
    s += lmnb.user("Give the final answer.")
    s += lmnb.assistant(fixed_gen("answer", 8))


@lmnb.function
def skeleton_of_thought(s: ProgramState, question: str, points: int) -> None:
    s += lmnb.system("You answer in a skeleton of short points, then expand each point.")
    s += lmnb.user(f"{question} Write a skeleton of {points} points, a few words each.")
    s += lmnb.assistant("1." + fixed_gen("skeleton", 16))
    forks = s.fork(points)
    forks += lambda i: lmnb.user(f"Expand point {i + 1} in one or two sentences.")
    forks += lambda i: lmnb.assistant(fixed_gen("detail", 16))
    s.join(forks, mode="concat_and_append")
    s += lmnb.user("Conclude in one sentence.")
    s += lmnb.assistant(fixed_gen("conclusion", 8))


DIMENSIONS = ("clarity", "originality", "evidence", "structure")


@lmnb.function
def branch_solve_merge(s: ProgramState, essay: str) -> None:
    s += lmnb.system("Evaluate an essay about a picture.")
    s += lmnb.user("Essay: " + essay)
    s += lmnb.assistant("Sure!")
    s += lmnb.user("Is the essay related to the picture?")
    # The paper returns early on "no"; here every essay is judged, so that work is fixed.
    s += lmnb.assistant(lmnb.select("related", choices=["yes", "no"]))
    forks = s.fork(len(DIMENSIONS))
    forks += lambda i: lmnb.user(f"Evaluate based on the following dimension: {DIMENSIONS[i]}.")
    forks += lmnb.assistant("Judgment: " + fixed_gen("judgment", 12))
    judgment = "\n".join(f"{d}: {f['judgment']}" for d, f in zip(DIMENSIONS, forks, strict=True))
    s += lmnb.user("Provide the judgment, summary, and a letter grade.")
    s += lmnb.assistant(judgment + "\nIn summary," + fixed_gen("summary", 8)
                        + "\nThe grade of it is" + fixed_gen("grade", 3))


@lmnb.function
def multi_turn_chat(s: ProgramState, messages: list[str], tokens: int) -> None:
    s += lmnb.system("You are a helpful assistant. Answer briefly.")
    for turn, message in enumerate(messages):
        s += lmnb.user(message)
        s += lmnb.assistant(fixed_gen(f"reply{turn}", tokens))


@lmnb.function
def self_consistency(s: ProgramState, examples: str, question: str, paths: int) -> None:
    s += examples + "Question: " + question + "\nAnswer:"
    forks = s.fork(paths)
    forks += fixed_gen("reasoning", 16, temperature=0.7)
    s.join(forks)


@lmnb.function
def no_reuse(s: ProgramState, text: str) -> None:
    s += text + fixed_gen("continuation", 8)


# ---- workloads: data, then a job that runs the programs and returns how many ------------------
Job = Callable[[Any], int]


def mmlu(rng: random.Random, scale: float) -> Job:
    items = []
    for _ in range(_count(2, scale)):
        subject = _words(rng, 2, 2)
        examples = (f"The following are multiple choice questions (with answers) about "
                    f"{subject}.\n\n"
                    + "".join(f"{_mc_question(rng)} {rng.choice('ABCD')}\n\n" for _ in range(5)))
        items += [{"examples": examples, "question": _mc_question(rng)} for _ in range(6)]
    return lambda backend: check_states(few_shot_mmlu.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0))


def hellaswag(rng: random.Random, scale: float) -> Job:
    examples = "".join(f"{_sentence(rng, 6, 8, ',')} {_words(rng, 4, 6)}.\n\n" for _ in range(20))
    items = [{"context": _sentence(rng, 6, 8, ","),
              "endings": [f" {_words(rng, 4, 6)}." for _ in range(4)]}
             for _ in range(_count(4, scale))]
    # Bound like SGLang's constant few-shot text. (lmnb's tracer gives up on select(choices=an
    # argument), so run_batch sends no prefix hint here; the cache-aware scheduler shares it.)
    program = few_shot_hellaswag.bind(examples=examples)
    return lambda backend: check_states(program.run_batch(items, backend=backend,
                                                          progress_bar=False))


def tree_of_thought_workload(rng: random.Random, scale: float) -> Job:
    items = [{"question": _sentence(rng, 20, 30, "?"), "width": 3, "critics": 2}
             for _ in range(_count(2, scale))]
    return lambda backend: check_states(tree_of_thought.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0))


def skeleton_of_thought_workload(rng: random.Random, scale: float) -> Job:
    items = [{"question": _sentence(rng, 20, 30, "?"), "points": 4}
             for _ in range(_count(2, scale))]
    return lambda backend: check_states(skeleton_of_thought.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0))


def judge(rng: random.Random, scale: float) -> Job:
    items = [{"essay": " ".join(_sentence(rng, 12, 18) for _ in range(6))}
             for _ in range(_count(2, scale))]
    return lambda backend: check_states(branch_solve_merge.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0))


def chat(tokens: int, sessions: int) -> Callable[[random.Random, float], Job]:
    def workload(rng: random.Random, scale: float) -> Job:
        items = [{"messages": [_sentence(rng, 20, 30) for _ in range(4)], "tokens": tokens}
                 for _ in range(_count(sessions, scale))]
        return lambda backend: check_states(multi_turn_chat.run_batch(
            items, backend=backend, progress_bar=False, temperature=0.0))

    return workload


def self_consistency_workload(rng: random.Random, scale: float) -> Job:
    examples = "Solve the problem. Think step by step, then give the answer.\n\n" + "".join(
        f"Question: {_sentence(rng, 20, 25, '?')}\nAnswer: {_sentence(rng, 20, 25)} "
        f"The answer is {rng.randint(2, 99)}.\n\n" for _ in range(2))
    items = [{"question": _sentence(rng, 20, 25, "?"), "paths": 4}
             for _ in range(_count(2, scale))]
    program = self_consistency.bind(examples=examples)
    return lambda backend: check_states(program.run_batch(items, backend=backend,
                                                          progress_bar=False))


def no_reuse_workload(rng: random.Random, scale: float) -> Job:
    count = _count(12, scale)
    firsts = [rng.choice(WORDS) + str(i) for i in range(count)]  # distinct first tokens
    items = [{"text": f"{first.capitalize()} {_words(rng, 90, 110)}."} for first in firsts]
    return lambda backend: check_states(no_reuse.run_batch(
        items, backend=backend, progress_bar=False, temperature=0.0))


WORKLOADS: dict[str, Callable[[random.Random, float], Job]] = {
    "mmlu": mmlu,
    "hellaswag": hellaswag,
    "tree-of-thought": tree_of_thought_workload,
    "skeleton-of-thought": skeleton_of_thought_workload,
    "judge": judge,
    "chat-short": chat(tokens=8, sessions=4),
    "chat-long": chat(tokens=48, sessions=4),
    "self-consistency": self_consistency_workload,
    "no-reuse": no_reuse_workload,
}


# ---- measuring -----------------------------------------------------------------------------------
def run_workload(runtime: Any, name: str, scale: float) -> dict[str, Any]:
    """Runs one workload's programs on `runtime` and measures them."""
    from lmnb.lang.backends.local import LocalBackend

    job = WORKLOADS[name](random.Random(SEED), scale)
    recorder = RecordingRuntime(runtime)
    backend = LocalBackend(recorder)
    before = runtime.stats()
    cpu_start = time.process_time()
    with stopwatch(runtime.device) as timing:
        programs = job(backend)
    cpu_seconds = time.process_time() - cpu_start
    after = runtime.stats()
    requests = recorder.requests
    prompt_tokens = sum(r.meta_info["prompt_tokens"] for r in requests)
    cached_tokens = sum(r.meta_info["cached_tokens"] for r in requests)
    output_tokens = sum(r.meta_info["completion_tokens"] for r in requests)
    optimal_computed = optimal_computed_tokens(requests)
    prompt_only = prompt_only_optimum([r.input_ids for r in requests])
    seconds = timing["seconds"]
    hit_rate = cached_tokens / max(prompt_tokens, 1)
    optimal = 1.0 - optimal_computed / max(prompt_tokens, 1)
    return {
        "programs": programs,
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "programs_per_s": programs / seconds,
        "tokens_per_s": output_tokens / seconds,
        "cpu_seconds": cpu_seconds,  # this process's CPU time: less sensitive to other load
        "hit_rate": hit_rate,
        "optimal_hit_rate": optimal,
        "achieved_over_optimal": hit_rate / optimal if optimal > 0 else None,
        "computed_prompt_tokens": prompt_tokens - cached_tokens,
        "optimal_computed_tokens": optimal_computed,
        # The optimum without crediting decoded KV (prompts alone, optimal.py's rule).
        "prompt_only_optimal_hit_rate": 1.0 - prompt_only / max(prompt_tokens, 1),
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
    parser.add_argument("--dummy-config", default=None, choices=sorted(DUMMY_CONFIGS),
                        help="random weights of this architecture instead of --model")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for --dummy-config (default: the embedded "
                             "SmolLM2's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies program counts")
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
    if args.dummy_config and args.model:
        parser.error("--model and --dummy-config exclude each other")
    if args.tokenizer and not args.dummy_config:
        parser.error("--tokenizer goes with --dummy-config (a --model has its own)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from lmnb.runtime.engine import Runtime

    hf_logging.set_verbosity_error()
    options: dict[str, Any] = dict(device=args.device, max_total_tokens=args.max_total_tokens)
    model_label = args.model or "embedded SmolLM2-135M-Instruct"
    scratch = None
    model_path = args.model
    if args.dummy_config:
        scratch = tempfile.TemporaryDirectory(prefix="lmnb-programs-")
        dummy = write_dummy_model(args.dummy_config, scratch.name, args.tokenizer)
        model_path = str(dummy.path)
        options.update(dummy.runtime_options())
        model_label = dummy.label
    runtimes = {"on": Runtime(model_path, **options),
                "off": Runtime(model_path, disable_radix_cache=True, **options)}
    results: dict[str, dict[str, Any]] = {}
    try:
        for rt in runtimes.values():  # warm-up
            rt.generate("Hello, world.", {"max_new_tokens": 4, "temperature": 0.0})
        device = runtimes["on"].device
        print(f"programs: {', '.join(args.workloads)}; scale {args.scale}; "
              f"{model_label}, {device}")
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
            on, off = results[name]["on"], results[name]["off"]
            print(f"  {name}: {on['seconds']:.1f} s on, {off['seconds']:.1f} s off", flush=True)
    finally:
        for rt in runtimes.values():
            rt.close()
        if scratch is not None:
            scratch.cleanup()

    rows = []
    for name, by_mode in results.items():
        for mode, r in by_mode.items():
            rows.append((name, mode, r["programs"], r["requests"], r["prompt_tokens"],
                         r["output_tokens"], r["seconds"], r["cpu_seconds_min"],
                         r["programs_per_s"], r["tokens_per_s"], r["hit_rate"],
                         r["optimal_hit_rate"],
                         r["achieved_over_optimal"] if mode == "on"
                         and r["optimal_hit_rate"] >= 0.01 else None))
    print(format_table(["workload", "cache", "programs", "reqs", "prompt tok", "output tok",
                        "seconds", "cpu s", "prog/s", "out tok/s", "hit rate", "optimal",
                        "hit/optimal"], rows))
    ratios = {name: r["on"]["programs_per_s"] / r["off"]["programs_per_s"]
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
            "model": model_label,
            "workloads": args.workloads,
            "scale": args.scale,
            "repeats": args.repeats,
            "max_total_tokens": args.max_total_tokens,
            "seed": SEED,
            "schedule_policy": "lpm",
            "frontend": "lmnb DSL, run_batch on LocalBackend",
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
