"""JSON decoding with a schema (SGLang paper, Section 6 "JSON decoding"): extract facts about a city
from a generated document into a JSON object whose keys are long constants, with jump-forward
(compressed FSM) on and off.

The documents come from a seeded RNG (invented city names, shuffled fact sentences and filler), the
prompt is the model's chat template, decoding is greedy. Two Runtimes on the same model run the
same batch, one `generate` call each, after a one-request warm-up each; each builds its own token
index lazily, so mask computation is part of both measurements. Reported: requests/s, completion
tokens/s, forward passes, jump-forward tokens, valid outputs, and the on/off ratios. The TokenIndex
of the schema's regex is also built whole (`build_all`) over the model's vocabulary in a fresh
process, to time the cost that lazy building spreads over requests.

    python bench/json_decode.py                          # 16 requests, embedded SmolLM2 on CPU
    python bench/json_decode.py --num-requests 32 --max-new-tokens 200
    python bench/json_decode.py --dummy-config llama-2-7b --tokenizer .gpu/tokenizer   # GPU

`--dummy-config NAME` runs random weights of a real architecture (its vocabulary grown to the
tokenizer's): the text is meaningless, but constrained decoding keeps every output inside the
schema's regex (every string has a maxLength, every number a range), so outputs are valid JSON
unless `--max-new-tokens` cuts them (its default is higher for random weights, which may spell the
keys in short tokens when jump-forward is off).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
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
MAX_NEW_TOKENS = 256
# Random weights may spell the ~330 characters of keys in one- or two-character tokens; the
# schema bounds an output to well under this many characters, so a cut output means a bug.
DUMMY_MAX_NEW_TOKENS = 1024
KEYS = {
    "name_of_the_city_described_in_the_document": {"type": "string", "maxLength": 24},
    "name_of_the_country_where_the_city_is_located": {"type": "string", "maxLength": 24},
    "population_of_the_city_in_thousands_of_inhabitants": {
        "type": "integer", "minimum": 0, "maximum": 99999},
    "year_in_which_the_city_was_founded_according_to_the_document": {
        "type": "integer", "minimum": 0, "maximum": 2100},
    "total_area_of_the_city_in_square_kilometers": {
        "type": "integer", "minimum": 0, "maximum": 99999},
    "whether_the_city_is_the_capital_of_its_country": {"type": "boolean"},
    "full_name_of_the_current_mayor_of_the_city": {"type": "string", "maxLength": 32},
}
SCHEMA: dict[str, Any] = {"type": "object", "properties": KEYS, "required": list(KEYS)}

_SYLLABLES = ["ka", "lo", "ri", "ven", "dor", "mar", "sel", "tu", "bra", "nis", "quel", "an",
              "os", "per", "ly", "zan", "mir", "go", "thea", "ul"]
_FIRST = ["Anna", "Marek", "Sofia", "Jonas", "Elena", "Tomas", "Ines", "Pavel", "Lucia", "Omar"]
_FILLER = [
    "The old town is known for its narrow streets and colorful markets.",
    "Visitors often praise the local bakeries and the river promenade.",
    "A tram network connects the center with the outer districts.",
    "Every summer the city hosts a music festival in the central square.",
    "The climate is mild, with warm summers and rainy autumns.",
    "Several bridges cross the river that divides the city in two.",
]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def make_documents(num: int, seed: int = SEED) -> list[dict[str, Any]]:
    """`num` documents (text + the facts in it), the same for a given seed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num):
        city, country = _name(rng, rng.randint(2, 3)), _name(rng, 2) + "ia"
        facts = {"city": city, "country": country, "population": rng.randint(20, 9000),
                 "founded": rng.randint(800, 1950), "area": rng.randint(30, 2500),
                 "capital": rng.random() < 0.3,
                 "mayor": f"{rng.choice(_FIRST)} {_name(rng, 2)}"}
        sentences = [
            f"{city} is a city in {country}.",
            f"About {facts['population']} thousand people live in {city}.",
            f"The city was founded in the year {facts['founded']}.",
            f"It covers {facts['area']} square kilometers.",
            f"{city} is {'the' if facts['capital'] else 'not the'} capital of {country}.",
            f"The current mayor is {facts['mayor']}.",
            *rng.sample(_FILLER, 2),
        ]
        rng.shuffle(sentences)
        docs.append({"text": " ".join(sentences), "facts": facts})
    return docs


def make_prompt(tokenizer: Any, document: str) -> str:
    request = ("Extract the facts about the city from the document below as a JSON object.\n\n"
               f"Document: {document}")
    return tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                         add_generation_prompt=True)


def run_mode(model: str | None, *, options: dict[str, Any], jump: bool, prompts: list[str],
             max_new_tokens: int, regex: str) -> dict[str, Any]:
    """`options`: Runtime options besides jump-forward (device; a dummy model's loading)."""
    from lmnb.runtime.engine import Runtime

    params = {"json_schema": SCHEMA, "temperature": 0.0, "max_new_tokens": max_new_tokens}
    with Runtime(model, disable_jump_forward=not jump, **options) as rt:
        rt.generate(prompts[0], params)  # warm-up: first-use costs, masks of the early states
        rt.flush_cache()
        before = rt.stats()
        with stopwatch(rt.device) as timing:
            outs = rt.generate(prompts, params)
        after = rt.stats()
    valid = 0
    for out in outs:
        try:
            json.loads(out["text"])
        except json.JSONDecodeError:
            continue
        valid += bool(re.fullmatch(regex, out["text"]))
    seconds = timing["seconds"]
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "jump_forward": jump,
        "seconds": seconds,
        "requests": len(outs),
        "requests_per_s": len(outs) / seconds,
        "completion_tokens": completion,
        "tokens_per_s": completion / seconds,
        "forward_passes": after["forward_passes"] - before["forward_passes"],
        "jump_forward_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
        "jump_forward_steps": sum(o["meta_info"]["jump_forward_steps"] for o in outs),
        "valid_json": valid,
        "finish_stop": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs),
        "finish_length": sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs),
        "texts": [o["text"] for o in outs],
    }


def time_index_build(tokenizer_dir: str, vocab_size: int, regex: str) -> dict[str, Any]:
    """Builds the TokenIndex of `regex` over the model's vocabulary; run in a fresh process."""
    from lmnb.runtime.fsm.index import get_token_index, vocab_trie
    from lmnb.runtime.models import loader

    tokenizer = loader.load_tokenizer(tokenizer_dir)
    start = time.perf_counter()
    vocab_trie(tokenizer)  # per tokenizer, shared by every regex
    trie_seconds = time.perf_counter() - start
    start = time.perf_counter()
    index = get_token_index(regex, tokenizer, vocab_size=vocab_size)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    states = index.build_all()
    build_seconds = time.perf_counter() - start
    return {"vocab_size": vocab_size, "fsm_states": index.fsm.num_states,
            "token_states": states, "vocab_trie_seconds": trie_seconds,
            "regex_compile_seconds": compile_seconds, "build_all_seconds": build_seconds}


def _index_in_subprocess(tokenizer_dir: str, vocab_size: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--index-only",
               "--index-tokenizer", tokenizer_dir, "--index-vocab-size", str(vocab_size)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="HF folder or GGUF file (default: the embedded SmolLM2)")
    model.add_argument("--dummy-config", default=None, choices=sorted(DUMMY_CONFIGS),
                       help="random weights of this architecture (GPU)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for --dummy-config (default: the embedded "
                             "SmolLM2's)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"default {MAX_NEW_TOKENS} ({DUMMY_MAX_NEW_TOKENS} with "
                             "--dummy-config)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "json_decode.json")
    parser.add_argument("--index-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index-tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--index-vocab-size", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokenizer is not None and args.dummy_config is None:
        parser.error("--tokenizer goes with --dummy-config (a --model has its own)")
    if args.max_new_tokens is None:
        args.max_new_tokens = DUMMY_MAX_NEW_TOKENS if args.dummy_config else MAX_NEW_TOKENS
    if args.max_new_tokens < 1 or args.num_requests < 1:
        parser.error("--max-new-tokens and --num-requests must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lmnb.runtime.fsm.json_schema import json_schema_to_regex

    regex = json_schema_to_regex(SCHEMA)
    if args.index_only:
        print(json.dumps(time_index_build(args.index_tokenizer, args.index_vocab_size, regex)))
        return 0
    with tempfile.TemporaryDirectory(prefix="lmnb-json-") as scratch:
        return _run(args, regex, scratch)


def _run(args: argparse.Namespace, regex: str, scratch: str) -> int:
    from lmnb.runtime.models import loader

    device = str(resolve_device(args.device))
    options: dict[str, Any] = {"device": device}
    if args.dummy_config:
        dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
        model, label = str(dummy.path), dummy.label
        options.update(dummy.runtime_options())
        tokenizer_dir, vocab_size = str(dummy.tokenizer_path), dummy.fields["vocab_size"]
    else:
        model, label = args.model, args.model or "embedded SmolLM2-135M-Instruct"
        tokenizer_dir = str(loader.resolve_model_dir(args.model))
        vocab_size = loader.load_config(loader.resolve_model_dir(args.model)).vocab_size
    tokenizer = loader.load_tokenizer(tokenizer_dir)
    docs = make_documents(args.num_requests, args.seed)
    prompts = [make_prompt(tokenizer, doc["text"]) for doc in docs]
    print(f"json_decode: {len(prompts)} requests, {len(KEYS)} keys, "
          f"max_new_tokens {args.max_new_tokens}, device {device}, {label}")
    index = _index_in_subprocess(tokenizer_dir, vocab_size)
    results = [run_mode(model, options=options, jump=jump, prompts=prompts,
                        max_new_tokens=args.max_new_tokens, regex=regex)
               for jump in (False, True)]
    off, on = results
    rows = [["jump-forward " + ("on" if r["jump_forward"] else "off"), r["requests"],
             r["valid_json"], r["seconds"], r["requests_per_s"], r["tokens_per_s"],
             r["completion_tokens"], r["forward_passes"], r["jump_forward_tokens"]]
            for r in results]
    print(format_table(["system", "requests", "valid", "seconds", "req/s", "tokens/s",
                        "completion tokens", "forward passes", "jumped tokens"], rows))
    for r in results:
        if r["finish_length"]:
            print(f"warning: jump-forward {'on' if r['jump_forward'] else 'off'}: "
                  f"{r['finish_length']} outputs cut by --max-new-tokens")
    same = sum(a == b for a, b in zip(on["texts"], off["texts"], strict=True))
    ratios = {
        "throughput_on_over_off": on["requests_per_s"] / off["requests_per_s"],
        "forward_passes_off_over_on": off["forward_passes"] / max(on["forward_passes"], 1),
        "same_text": same,
    }
    print(f"TokenIndex build over a {index['vocab_size']:,}-token vocabulary: regex -> "
          f"{index['fsm_states']} FSM states in {index['regex_compile_seconds']:.2f} s, "
          f"build_all ({index['token_states']} states) {index['build_all_seconds']:.2f} s, "
          f"vocabulary trie {index['vocab_trie_seconds']:.2f} s (once per tokenizer)")
    print(f"identical outputs on/off: {same}/{len(prompts)} (jump-forward spells the keys in "
          "canonical tokens, token-by-token decoding may not)")
    print(f"jump-forward on / off: throughput {ratios['throughput_on_over_off']:.2f}x, "
          f"forward passes {ratios['forward_passes_off_over_on']:.2f}x fewer")
    payload = {
        "benchmark": "json_decode",
        "environment": environment(device),
        "config": {"model": label,
                   "num_requests": args.num_requests, "max_new_tokens": args.max_new_tokens,
                   "seed": args.seed, "schema": SCHEMA, "temperature": 0.0},
        "index": index,
        "results": [{k: v for k, v in r.items() if k != "texts"} for r in results],
        "ratios": ratios,
        "sample_output": on["texts"][0] if on["texts"] else None,
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
