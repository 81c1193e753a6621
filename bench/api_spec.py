"""API speculative execution (SGLang paper, Section 5): the character-description extraction, a
program of several fields each a `gen` ending at a newline, run through `lmnb.OpenAI` against an
OpenAI-compatible endpoint with speculation off and on (`@function(num_api_spec_tokens=N)`).

Without speculation every field is one API call whose prompt is the whole text so far; with it,
the first field's call keeps writing past its stop and the later fields are cut from that text
when it matches. Reported per run: API calls, billed prompt and completion tokens (the endpoint's
`usage`), wall time, whether every field's text is identical, and the off/on ratios.

    python bench/api_spec.py                       # the lmnb server over the embedded SmolLM2
    python bench/api_spec.py --base-url http://127.0.0.1:30000/v1 --model NAME

Without --base-url the lmnb server (`lmnb.server`) is started in-process on a free loopback port
over `lmnb.Runtime(--runtime-model)`; the prompts are a completion model's (`--chat` sends role
messages instead, which needs an endpoint that continues a final assistant message for the
non-speculative run). Decoding is greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmnb  # noqa: E402
from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from lmnb import assistant_begin, assistant_end, function, gen, user  # noqa: E402

FIELDS = ("Name", "Birthday", "Job", "House", "Wand", "Pet")
EXAMPLE = ("Character: Hermione Granger\nName: Hermione Jean Granger\nBirthday: 19 September 1979\n"
           "Job: Student at Hogwarts\nHouse: Gryffindor\nWand: Vine wood, dragon heartstring\n"
           "Pet: Crookshanks, a cat\n\n"
           "Character: Rubeus Hagrid\nName: Rubeus Hagrid\nBirthday: 6 December 1928\n"
           "Job: Keeper of Keys and Grounds at Hogwarts\nHouse: Gryffindor\nWand: Oak, snapped\n"
           "Pet: Fang, a boarhound\n\n")  # two examples of the form
CHARACTERS = ("Harry Potter", "Ron Weasley", "Draco Malfoy", "Luna Lovegood", "Neville Longbottom",
              "Albus Dumbledore", "Severus Snape", "Ginny Weasley")
INSTRUCTION = ("Below are character sheets from a wiki about the Harry Potter books, one field per "
               "line.\n\n")


def character_sheet(s: Any, character: str) -> None:
    """Completion model: the prompt is text; every field is a gen stopped by a newline."""
    s += INSTRUCTION + EXAMPLE + f"Character: {character}\n"
    for i, field in enumerate(FIELDS):
        s += ("\n" if i else "") + f"{field}:" + gen(field.lower(), stop="\n")


def character_sheet_chat(s: Any, character: str) -> None:
    """Chat model: the fields are the assistant's reply."""
    s += user(INSTRUCTION + EXAMPLE + f"Write the sheet of {character} in the same form.")
    s += assistant_begin()
    for i, field in enumerate(FIELDS):
        s += ("\n" if i else "") + f"{field}:" + gen(field.lower(), stop="\n")
    s += assistant_end()


def run_mode(backend: Any, program: Any, characters: list[str]) -> dict[str, Any]:
    backend.token_usage.reset()
    start = time.perf_counter()
    fields = []
    for character in characters:  # one at a time: calls and tokens per program are the point
        state = program.run(character=character, backend=backend, temperature=0)
        fields.append({f.lower(): state[f.lower()] for f in FIELDS})
    seconds = time.perf_counter() - start
    return {**backend.token_usage.as_dict(), "seconds": seconds, "fields": fields}


def start_server(model: str | None, device: str) -> tuple[Any, Any, str]:
    try:
        from lmnb.server import ServerHandle
    except ImportError as error:
        raise SystemExit(f"lmnb.server is not available ({error}); pass --base-url") from error
    runtime = lmnb.Runtime(model, device=device) if model else lmnb.Runtime(device=device)
    handle = ServerHandle.start(runtime)
    return runtime, handle, handle.url + "/v1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None,
                        help="an OpenAI-compatible endpoint (default: start the lmnb server)")
    parser.add_argument("--model", default=None, help="model name sent to the endpoint")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--runtime-model", default=None,
                        help="model of the in-process lmnb server (default: embedded SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chat", action="store_true", help="a chat model (role messages)")
    parser.add_argument("--num-characters", type=int, default=4)
    parser.add_argument("--num-api-spec-tokens", type=int, default=128)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "api_spec.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime = handle = None
    base_url = args.base_url
    device = "cpu"  # of this process; the endpoint's device is its own
    if base_url is None:
        device = args.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        runtime, handle, base_url = start_server(args.runtime_model, device)
    try:
        model = args.model
        if model is None:
            import openai

            client = openai.OpenAI(base_url=base_url, api_key=args.api_key or "EMPTY")
            model = client.models.list().data[0].id
        backend = lmnb.OpenAI(model, base_url=base_url, api_key=args.api_key,
                              is_chat_model=args.chat, continue_final_message=args.chat)
        body = character_sheet_chat if args.chat else character_sheet
        characters = [CHARACTERS[i % len(CHARACTERS)] for i in range(args.num_characters)]
        off = run_mode(backend, function(body), characters)
        on = run_mode(backend, function(num_api_spec_tokens=args.num_api_spec_tokens)(body),
                      characters)
    finally:
        if handle is not None:
            handle.stop()
        if runtime is not None:
            runtime.close()

    identical = off["fields"] == on["fields"]
    rows = [[name, r["calls"], r["prompt_tokens"], r["completion_tokens"], r["seconds"]]
            for name, r in (("speculation off", off), ("speculation on", on))]
    print(format_table(["run", "API calls", "prompt tokens", "completion tokens", "seconds"],
                       rows))
    ratios = {
        "calls_off_over_on": off["calls"] / max(on["calls"], 1),
        "prompt_tokens_off_over_on": off["prompt_tokens"] / max(on["prompt_tokens"], 1),
        "seconds_off_over_on": off["seconds"] / max(on["seconds"], 1e-9),
    }
    print(f"\nfields identical: {identical}; API calls {ratios['calls_off_over_on']:.2f}x fewer, "
          f"billed prompt tokens {ratios['prompt_tokens_off_over_on']:.2f}x fewer with "
          f"speculation (N={args.num_api_spec_tokens})")
    if not identical:
        for a, b in zip(off["fields"], on["fields"], strict=True):
            if a != b:
                print(f"  off: {a}\n  on:  {b}")
    payload = {
        "benchmark": "api_spec",
        "base_url": args.base_url or "lmnb server (in-process)",
        "model": model,
        "chat": args.chat,
        "num_characters": args.num_characters,
        "num_api_spec_tokens": args.num_api_spec_tokens,
        "off": off,
        "on": on,
        "fields_identical": identical,
        "ratios": ratios,
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
