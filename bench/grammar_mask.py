"""Grammar mask time per token: lmnb's compressed FSM vs xgrammar, on the JSON benchmark's schema
(`bench/json_decode.py`) with the embedded SmolLM2's tokenizer (vocabulary 49,152).

Each backend walks the same valid outputs (the facts of json_decode's seeded documents as JSON in
the canonical layout both backends generate), token by token as the scheduler does: the packed
mask of the next token (`Grammar.bitmask`, on the CPU), then `advance` by the token. Timed apart:
- setup: the per-tokenizer work done once (lmnb: the vocabulary byte trie; xgrammar: its
  `TokenizerInfo`) and the first request's grammar (lmnb: schema -> regex -> DFA; xgrammar: the
  compiled grammar);
- the first pass over the documents (lmnb computes each FSM state's mask the first time a request
  reaches it, then shares it; xgrammar's compile precomputes its token-mask cache, then combines
  it per step), also added to the first grammar's time (the cold cost of a new schema), and a
  second pass over the same documents (lmnb's masks are all cached by then, as they are in a
  server that has seen the schema before).
No model runs; this is the grammar's own cost per decoded token. The two passes of each backend
run in the same process, one after the other, on the same texts.

    python bench/grammar_mask.py                       # 64 documents
    python bench/grammar_mask.py --num-documents 256
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.json_decode import KEYS, SCHEMA, SEED, make_documents  # noqa: E402

BACKENDS = ("lmnb", "xgrammar")


def valid_outputs(num: int, seed: int) -> list[str]:
    """The facts of json_decode's documents as the JSON the schema asks for."""
    names = list(KEYS)
    texts = []
    for doc in make_documents(num, seed):
        facts = doc["facts"]
        values = [facts["city"], facts["country"], facts["population"], facts["founded"],
                  facts["area"], facts["capital"], facts["mayor"]]
        texts.append(json.dumps(dict(zip(names, values, strict=True)), ensure_ascii=False))
    return texts


def walk(factory: Any, params: Any, token_lists: list[list[int]], stops: frozenset[int]
         ) -> dict[str, float]:
    """One pass: a grammar per text, mask + advance per token, the final (stop) mask too."""
    mask_s = advance_s = make_s = 0.0
    masks = 0
    clock = time.perf_counter
    for ids in token_lists:
        start = clock()
        grammar = factory.make(params)
        make_s += clock() - start
        for token in ids:
            start = clock()
            grammar.bitmask(stops)
            mid = clock()
            grammar.advance(token)
            end = clock()
            mask_s += mid - start
            advance_s += end - mid
        start = clock()
        grammar.bitmask(stops)
        mask_s += clock() - start
        masks += len(ids) + 1
        if not grammar.is_final or grammar.is_dead:
            raise AssertionError("a valid text did not complete its grammar")
    return {"masks": masks, "seconds": mask_s + advance_s + make_s,
            "mask_us_per_token": mask_s / masks * 1e6,
            "advance_us_per_token": advance_s / masks * 1e6,
            "make_ms_per_request": make_s / len(token_lists) * 1e3}


def run_backend(backend: str, tokenizer: Any, *, vocab_size: int, eos: set[int],
                token_lists: list[list[int]]) -> dict[str, Any]:
    from lmnb.params import SamplingParams
    from lmnb.runtime.fsm.factory import GrammarFactory
    from lmnb.runtime.fsm.index import vocab_trie

    factory = GrammarFactory(tokenizer, vocab_size=vocab_size, eos_token_ids=eos, backend=backend)
    params = SamplingParams(json_schema=SCHEMA)
    start = time.perf_counter()
    if backend == "lmnb":
        vocab_trie(tokenizer)
    else:
        factory.xgrammar()
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    factory.make(params)
    first_grammar_s = time.perf_counter() - start
    stops = frozenset(eos)
    first = walk(factory, params, token_lists, stops)
    second = walk(factory, params, token_lists, stops)
    return {"backend": backend, "tokenizer_setup_s": tokenizer_s,
            "first_grammar_s": first_grammar_s, "first_pass": first, "second_pass": second}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-documents", type=int, default=64)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "grammar_mask.json")
    args = parser.parse_args(argv)
    if args.num_documents < 1:
        parser.error("--num-documents must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lmnb.runtime.fsm.json_schema import json_schema_to_regex
    from lmnb.runtime.models import loader

    model_dir = loader.resolve_model_dir(None)
    tokenizer = loader.load_tokenizer(model_dir)
    vocab_size = loader.load_config(model_dir).vocab_size
    eos = {int(tokenizer.eos_token_id)}
    texts = valid_outputs(args.num_documents, args.seed)
    regex = json_schema_to_regex(SCHEMA)
    if not all(re.fullmatch(regex, text) for text in texts):
        raise AssertionError("a benchmark text is not valid under the schema")
    token_lists = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    tokens = sum(len(ids) for ids in token_lists)
    print(f"grammar_mask: {len(texts)} JSON outputs of json_decode's schema, {tokens:,} tokens "
          f"(+1 final mask each), SmolLM2 tokenizer (vocab {vocab_size:,}), CPU")
    results = {b: run_backend(b, tokenizer, vocab_size=vocab_size, eos=eos,
                              token_lists=token_lists) for b in BACKENDS}
    rows = []
    for name in BACKENDS:
        r = results[name]
        r["cold_s"] = r["first_grammar_s"] + r["first_pass"]["seconds"]
        rows.append([name, r["tokenizer_setup_s"] * 1e3, r["first_grammar_s"] * 1e3,
                     r["cold_s"] * 1e3,
                     r["first_pass"]["mask_us_per_token"], r["second_pass"]["mask_us_per_token"],
                     r["second_pass"]["advance_us_per_token"],
                     r["second_pass"]["make_ms_per_request"]])
    ours, theirs = results["lmnb"], results["xgrammar"]
    ratios = {
        "mask_first_pass_lmnb_over_xgrammar": (ours["first_pass"]["mask_us_per_token"]
                                               / theirs["first_pass"]["mask_us_per_token"]),
        "mask_second_pass_lmnb_over_xgrammar": (ours["second_pass"]["mask_us_per_token"]
                                                / theirs["second_pass"]["mask_us_per_token"]),
        "first_grammar_lmnb_over_xgrammar": ours["first_grammar_s"] / theirs["first_grammar_s"],
        "cold_lmnb_over_xgrammar": ours["cold_s"] / theirs["cold_s"],
    }
    rows.append(["lmnb / xgrammar", None, ratios["first_grammar_lmnb_over_xgrammar"],
                 ratios["cold_lmnb_over_xgrammar"], ratios["mask_first_pass_lmnb_over_xgrammar"],
                 ratios["mask_second_pass_lmnb_over_xgrammar"], None, None])
    print(format_table(["backend", "tokenizer setup ms", "first grammar ms",
                        "grammar + pass 1 ms", "mask us/token, pass 1", "mask us/token, pass 2",
                        "advance us/token", "grammar per request ms"], rows))
    print(f"mask time per token, lmnb / xgrammar: first pass "
          f"{ratios['mask_first_pass_lmnb_over_xgrammar']:.2f}x, second pass "
          f"{ratios['mask_second_pass_lmnb_over_xgrammar']:.2f}x; first grammar + first pass "
          f"{ratios['cold_lmnb_over_xgrammar']:.2f}x")
    payload = {
        "benchmark": "grammar_mask",
        "environment": environment("cpu"),
        "config": {"num_documents": args.num_documents, "seed": args.seed, "schema": SCHEMA,
                   "tokens": tokens, "vocab_size": vocab_size},
        "results": results,
        "ratios": ratios,
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
