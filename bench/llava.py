"""LLaVA image QA with repeated images: 8 questions share each of 16 images, radix cache on vs off.

One DSL program per image, run with `run_batch` on a `LocalBackend`: the user turn opens with the
image, the program forks into one branch per question (the fork sends the image prefix to the
cache first, so with the radix cache every branch finds the image's span cached), and each branch
asks its question and decodes exactly `--output-len` tokens (`ignore_eos`). Both modes run the
same programs on a runtime of the same model, one with the radix cache and one with
`disable_radix_cache=True`; both keep the media embeddings cache (the vision tower runs once per
image either way): what differs is the language model's prefill of the image spans.

Images are deterministic random pictures (seeded numpy; distinct content, so distinct hashes);
questions come from a fixed list. The hit rate is cached / prompt tokens over the workload's
requests (the fork's cache hints included); the optimum is Theorem 3.1's over the same requests'
token ids, image spans expanded to their hashed pad ids (`lmnb.runtime.radix.optimal`).

    python bench/llava.py --quick                  # CPU check: tiny random LLaVA-1.5, 4x4
    python bench/llava.py                          # tiny random LLaVA-1.5, 16 images x 8 questions
    python bench/llava.py --model llava-1.5-7b     # GPU: random LLaVA-1.5-7B weights (dummy load)

`llava-1.5-7b` is llava-hf/llava-1.5-7b-hf's architecture with random weights: CLIP ViT-L/14 at
336 px (576 tokens an image) and Llama-2-7B, fp16, loaded with `load_format="dummy"`. Its
tokenizer is the embedded SmolLM2's with `<image>` added (49,216 embedding rows instead of
Llama-2's 32,064: +1.4% of the weights); `--tokenizer FOLDER` takes another (e.g. Llama-2's).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import lmnb  # noqa: E402
from bench.common import RESULTS_DIR, environment, format_table, stopwatch, write_json  # noqa: E402
from lmnb import assistant, gen, image, user_begin, user_end  # noqa: E402

SEED = 0
QUESTIONS = [
    "What is shown in this picture?",
    "Which colors stand out the most?",
    "Is there a person in the picture?",
    "Describe the background in one sentence.",
    "What would be a good title for this image?",
    "Is the picture taken indoors or outdoors?",
    "How many distinct objects can you see?",
    "What mood does the picture convey?",
]


# ---- workload --------------------------------------------------------------------------------
def make_images(count: int, seed: int = SEED) -> list[np.ndarray]:
    """`count` distinct uint8 RGB pictures of assorted sizes: smooth color fields plus noise."""
    rng = np.random.default_rng(seed)
    sizes = [(336, 336), (480, 640), (640, 480), (400, 400)]
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        phase = rng.uniform(0, 2 * np.pi, size=3)
        freq = rng.uniform(2, 8, size=3)
        field = np.stack([np.sin(freq[c] * (x + y * (c + 1)) + phase[c]) for c in range(3)], -1)
        noise = rng.normal(0, 0.15, size=(h, w, 3))
        images.append(((field * 0.5 + 0.5 + noise).clip(0, 1) * 255).astype(np.uint8))
    return images


@lmnb.function
def image_qa(s, picture, questions, output_len):
    s += user_begin() + image(picture)
    forks = s.fork(len(questions))
    forks += [q + user_end() + assistant(gen("answer", max_tokens=output_len,
                                             min_tokens=output_len, ignore_eos=True))
              for q in questions]
    forks.join()


class RecordingRuntime:
    """The runtime under the backend, recording every request's prompt and media (to compute
    the optimum over their expanded token ids afterwards); everything else passes through."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.calls: list[tuple[Any, Any, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        media = {k: kwargs.get(k) for k in ("image_data", "video_data")}
        with self._lock:
            self.calls.append((prompt, kwargs.get("input_ids"), media))
        return self.runtime.generate(prompt, sampling_params, **kwargs)

    def cache_prefix(self, prompt: Any = None, **kwargs: Any) -> int:
        out = self.generate(prompt, {"max_new_tokens": 0}, **kwargs)
        return out["meta_info"]["prompt_tokens"]

    def expanded_prompts(self) -> list[list[int]]:
        """Each recorded request's prompt ids as the runtime saw them (media spans expanded)."""
        runtime, processor = self.runtime, self.runtime.media_processor
        prompts = []
        for prompt, input_ids, media in self.calls:
            ids = runtime.encode(prompt) if isinstance(prompt, str) else list(input_ids)
            items = [processor.item(kind, source)
                     for kind in ("image", "video") for source in media[f"{kind}_data"] or ()]
            prompts.append(processor.expand(ids, items) if items else ids)
        return prompts


def run_workload(runtime: Any, images: list[np.ndarray], questions: list[str],
                 output_len: int) -> dict[str, Any]:
    from lmnb.lang.backends.local import LocalBackend
    from lmnb.runtime.radix.optimal import optimal_hit_rate

    recorder = RecordingRuntime(runtime)
    backend = LocalBackend(recorder)
    before = runtime.stats()
    with stopwatch(runtime.device) as timing:
        states = image_qa.run_batch(
            [{"picture": picture, "questions": questions, "output_len": output_len}
             for picture in images], backend=backend, temperature=0.0)
    for state in states:
        state.sync()
        if state.error() is not None:
            raise RuntimeError(f"a program failed: {state.error()!r}")
    after = runtime.stats()
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "media_tokens",
                       "cached_media_tokens", "vision_tower_runs", "forward_passes",
                       "evicted_tokens")}
    seconds = timing["seconds"]
    hit_rate = delta["cached_tokens"] / max(delta["prompt_tokens"], 1)
    optimal = optimal_hit_rate(recorder.expanded_prompts())
    answers = len(images) * len(questions)
    return {
        "programs": len(images), "answers": answers, "requests": len(recorder.calls),
        **delta, "seconds": seconds,
        "answers_per_s": answers / seconds,
        "output_tokens_per_s": delta["generated_tokens"] / seconds,
        "hit_rate": hit_rate, "optimal_hit_rate": optimal,
        "achieved_over_optimal": hit_rate / optimal if optimal > 0 else None,
        "media_hit_rate": delta["cached_media_tokens"] / max(delta["media_tokens"], 1),
    }


# ---- models ----------------------------------------------------------------------------------
def model_folder(args: argparse.Namespace, scratch: Path) -> tuple[Path, dict[str, Any], str]:
    """(folder, Runtime options, label) of `--model`."""
    from lmnb.multimodal.testing import CLIP_VIT_L_14_336, LLAMA_2_7B, build_llava, tiny_llava

    if args.model == "tiny":
        folder = tiny_llava(scratch / "tiny-llava-1.5", "llava-1.5",
                            tokenizer_dir=args.tokenizer)
        return folder, {}, "tiny random LLaVA-1.5 (336 px / 14 px patches: 576 tokens an image)"
    if args.model == "llava-1.5-7b":
        folder = build_llava(scratch / "llava-1.5-7b", variant="llava-1.5", text=LLAMA_2_7B,
                             vision=CLIP_VIT_L_14_336, tokenizer_dir=args.tokenizer,
                             weights=False, dtype="float16")
        return folder, {"load_format": "dummy"}, ("random LLaVA-1.5-7B (CLIP ViT-L/14-336 + "
                                                   "Llama-2-7B, fp16, dummy load)")
    return Path(args.model), {}, str(args.model)


def _release(device: Any) -> None:
    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny",
                        help="tiny (default), llava-1.5-7b (random weights, GPU) or a llava-hf "
                             "folder")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for tiny / llava-1.5-7b (default: SmolLM2's)")
    parser.add_argument("--quick", action="store_true",
                        help="4 images x 4 questions, 4 output tokens (a fast check)")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--questions", type=int, default=8, help=f"at most {len(QUESTIONS)}")
    parser.add_argument("--output-len", type=int, default=None,
                        help="tokens decoded per answer (default: 32 on CUDA, 8 on CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size in tokens (default: sized from free memory)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per mode, alternating; the fastest counts")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "llava.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.questions = 4, 4
        args.output_len = args.output_len or 4
    if not 1 <= args.questions <= len(QUESTIONS) or args.images < 1 or args.repeats < 1:
        parser.error(f"--images, --repeats >= 1 and 1 <= --questions <= {len(QUESTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    from bench.common import resolve_device
    from lmnb.runtime.engine import Runtime

    hf_logging.set_verbosity_error()
    device = resolve_device(args.device)
    output_len = args.output_len or (32 if device.type == "cuda" else 8)
    images = make_images(args.images)
    questions = QUESTIONS[:args.questions]
    warmup = make_images(1, seed=SEED + 1)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="lmnb-bench-llava-") as scratch:
        folder, load_options, label = model_folder(args, Path(scratch))
        options = dict(device=str(device), max_total_tokens=args.max_total_tokens,
                       **load_options)
        print(f"llava: {label} on {device}; {args.images} images x {args.questions} questions, "
              f"{output_len} output tokens each", flush=True)
        for repeat in range(args.repeats):
            # One runtime at a time (two 7B models need not fit together); alternate the order.
            for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                rt = Runtime(folder, disable_radix_cache=(mode == "off"), **options)
                try:
                    run_workload(rt, warmup, questions[:2], 2)  # compile, capture, allocate
                    if not rt.flush_cache():
                        raise RuntimeError("flush_cache refused: requests still in flight")
                    result = run_workload(rt, images, questions, output_len)
                finally:
                    rt.close()
                    _release(device)
                runs[mode].append(result)
                print(f"  cache {mode}: {result['seconds']:.2f} s, hit rate "
                      f"{result['hit_rate']:.1%}", flush=True)
    results = {mode: {**min(r, key=lambda x: x["seconds"]),
                      "seconds_all": [x["seconds"] for x in r]} for mode, r in runs.items()}
    rows = [(mode, r["answers"], r["requests"], r["prompt_tokens"], r["media_tokens"],
             r["generated_tokens"], r["seconds"], r["answers_per_s"], r["output_tokens_per_s"],
             r["hit_rate"], r["media_hit_rate"], r["optimal_hit_rate"],
             r["achieved_over_optimal"] if mode == "on" else None)
            for mode, r in results.items()]
    print(format_table(["cache", "answers", "reqs", "prompt tok", "image tok", "output tok",
                        "seconds", "answers/s", "out tok/s", "hit rate", "image hit rate",
                        "optimal", "hit/optimal"], rows))
    on, off = results["on"], results["off"]
    ratio = on["answers_per_s"] / off["answers_per_s"]
    print(f"throughput cache on / off: {ratio:.2f}x; hit rate {on['hit_rate']:.1%} of an "
          f"optimal {on['optimal_hit_rate']:.1%} ({on['achieved_over_optimal']:.1%} of it)")
    payload = {
        "benchmark": "llava",
        "config": {"model": label, "model_arg": args.model, "images": args.images,
                   "questions": args.questions, "output_len": output_len,
                   "repeats": args.repeats, "max_total_tokens": args.max_total_tokens,
                   "seed": SEED, "frontend": "lmnb DSL: run_batch over images, fork per "
                   "question, LocalBackend"},
        "results": results,
        "ratio_on_over_off": ratio,
        "hit_rate_over_optimal": on["achieved_over_optimal"],
        "environment": environment(device),
        "time_unix": time.time(),
    }
    print(f"wrote {write_json(args.output, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
