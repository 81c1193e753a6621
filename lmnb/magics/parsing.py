"""Argument parsing for `%lmnb` and `%%lmprogram`: argparse with IPython's UsageError for mistakes.

A `%%lmprogram` line is `[VAR <<] [NAME(ARGS)] [options]`: `VAR <<` captures the result (as in
jupysql), `NAME(ARGS)` defines a program instead of running the cell.
"""

from __future__ import annotations

import argparse
import keyword
import re
import shlex
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from lmnb.params import param_help

_CAPTURE = re.compile(r"^\s*([A-Za-z_]\w*)\s*<<(.*)$", re.DOTALL)
_NAME = re.compile(r"^\s*([A-Za-z_]\w*)\s*(\(?)")


class HelpShown(Exception):
    """`--help` printed the usage; nothing else to do."""


class MagicArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # sub-command parsers, by name

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            raise UsageError(message)
        raise HelpShown()


def lmnb_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(
        prog="%lmnb", description="Manage the kernel's lmnb runtime (one model, kept loaded "
        "between cells). Options default to `%config LMNB.<option>`.",
        epilog="Run `%lmnb COMMAND --help` for a command's options; `%%lmprogram --help` for "
        "the cell magic.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = commands.choices
    load = commands.add_parser(
        "load", help="load a model, replacing the current one",
        description="Load a model into the kernel, closing the current one first. MODEL is an "
        "HF folder or a .gguf file; without it, LMNB.model or the embedded "
        "SmolLM2-135M-Instruct.")
    load.add_argument("model", nargs="?", metavar="MODEL", help="model folder or .gguf file")
    load.add_argument("--dtype", help="auto, float32, float16 or bfloat16")
    load.add_argument("--device", help="auto, cpu, cuda, cuda:1, ...")
    load.add_argument("--max-total-tokens", type=int, metavar="N", help="KV cache size in tokens")
    load.add_argument("--schedule-policy", metavar="POLICY", help="lpm (default), fcfs, ...")
    load.add_argument("--sampling-defaults", choices=["model", "openai"],
                      help="an OpenAI request's omitted sampling parameters: the model's "
                      "generation_config.json (model, the default) or OpenAI's")
    load.add_argument("--disable-radix-cache", action="store_true",
                      help="no prefix reuse (for comparisons)")
    load.add_argument("--enable-hierarchical-cache", action="store_true",
                      help="keep KV evicted from the device in host memory")
    load.add_argument("--hicache-ratio", type=float, metavar="R",
                      help="host tier size as a multiple of the KV pool (default 2)")
    load.add_argument("--hicache-storage-dir", metavar="DIR",
                      help="also keep KV pages on disk in DIR, across kernel restarts "
                      "(implies --enable-hierarchical-cache)")
    commands.add_parser("status", help="cache hit rate, KV usage, radix tree (a dashboard)",
                        description="Show the runtime's cache and scheduler statistics.")
    commands.add_parser("media", help="images/videos in the cache: hash, tokens, hits (LLaVA)",
                        description="Show the runtime's media (MediaReuseView): thumbnails, "
                        "content hash, tokens, requests and hits, resident or evicted; live.")
    commands.add_parser("flush", help="empty the prefix cache (refused while requests run)",
                        description="Empty the radix prefix cache.")
    commands.add_parser("close", help="stop the runtime and free its memory",
                        description="Close the runtime: abort what runs, stop its threads, free "
                        "the model and KV memory.")
    serve = commands.add_parser(
        "serve", help="serve the runtime over HTTP (OpenAI, SGLang, Anthropic, Ollama APIs)",
        description="Serve the kernel's runtime (same KV cache) from a background thread; "
        "`%lmnb serve stop` stops it.")
    serve.add_argument("action", nargs="?", choices=["stop"], help="stop the server")
    serve.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    serve.add_argument("--port", type=int, default=0, metavar="N", help="default: a free port")
    serve.add_argument("--api-key", metavar="KEY",
                       help="require `Authorization: Bearer KEY` on every route but /health")
    serve.add_argument("--max-request-bytes", type=int, default=32 * 2**20, metavar="N",
                       help="larger request bodies are refused (HTTP 413); default 32 MiB")
    commands.add_parser("help", help="show this help", description="Show help for every command.")
    return parser


def full_help(parser: MagicArgumentParser) -> str:
    """The parser's help followed by each command's."""
    parts = [parser.format_help()]
    parts.extend(f"\n{sub.format_help()}" for name, sub in parser.commands.items()
                 if name != "help")
    return "".join(parts)


def lmprogram_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(
        prog="%%lmprogram", usage="%%%%lmprogram [VAR <<] [NAME(ARGS)] [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run the cell as an lmnb program on `s`, or define a reusable program.

  %%lmprogram                    run the cell now; its state is the cell's result
  %%lmprogram answer <<          ... and store it in `answer` (as -o answer)
  %%lmprogram qa(question, n=2)  define program `qa` (an lmnb.Program; not run):
                                 qa.run(question=...), qa.run_batch([...])

The cell body is the body of `def f(s, ...)`: `s += user("hi")`, `s["var"]`, `s.fork(2)`.
The DSL names (gen, select, gen_int, gen_string, image, video, system/user/assistant and their
_begin/_end, function, lmnb) need no import; notebook variables are visible and win over
them; names assigned in the cell stay local to it. Ctrl-C aborts the program's requests.""")
    parser.add_argument("-o", "--out", metavar="VAR", help="store the result in VAR (no display)")
    parser.add_argument("--temperature", type=float,
                        help=f"every gen's default: {param_help('temperature')}")
    parser.add_argument("--max-tokens", type=int, metavar="N", dest="max_new_tokens",
                        help=f"every gen's default: {param_help('max_new_tokens')}")
    parser.add_argument("--top-p", type=float, help=f"every gen's default: {param_help('top_p')}")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="show the text live as it is generated (default: LMNB.stream)")
    parser.add_argument("--trace", action="store_true",
                        help="print the traced graph of the program instead of running it")
    parser.add_argument("--bg", action="store_true",
                        help="run in the background: the result is a handle at once")
    parser.add_argument("--tokens", action="store_true",
                        help="show every token live, coloured by origin (prompt computed or "
                             "cached, generated, jump-forward), logprobs on hover, and a "
                             "metrics bar (lmnb.widgets.TokenView)")
    return parser


@dataclass(frozen=True)
class ProgramLine:
    capture: str | None
    name: str | None
    signature: str
    options: argparse.Namespace


def _split_signature(text: str) -> tuple[str, str]:
    """`(a, b=f(1)) --rest` -> (`a, b=f(1)`, `--rest`); `text` starts with `(`."""
    depth, quote = 0, ""
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return text[1:index], text[index + 1:]
    raise UsageError(f"unbalanced parentheses in %%lmprogram {text}")


def _identifier(name: str, what: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"{what} must be a Python name, got {name!r}")
    return name


def parse_program_line(line: str, parser: MagicArgumentParser) -> ProgramLine:
    capture = None
    if match := _CAPTURE.match(line):
        capture, line = match.group(1), match.group(2)
    name, signature = None, ""
    match = _NAME.match(line)
    if match and not line.lstrip().startswith("-"):
        if not match.group(2):
            word = match.group(1)
            raise UsageError(f"%%lmprogram {word}: write `{word}(...)` to define a program or "
                             f"`{word} <<` to store the cell's result")
        name = _identifier(match.group(1), "a program name")
        signature, line = _split_signature(line[match.end() - 1:])
    try:
        words = shlex.split(line)
    except ValueError as error:
        raise UsageError(f"%%lmprogram: {error}") from None
    options = parser.parse_args(words)
    if options.out is not None:
        if capture is not None:
            raise UsageError("give either `VAR <<` or -o VAR, not both")
        capture = _identifier(options.out, "-o")
    if name is not None:
        running = [flag for flag, value in (("VAR <</-o", capture), ("--bg", options.bg),
                                            ("--stream", options.stream),
                                            ("--temperature", options.temperature),
                                            ("--max-tokens", options.max_new_tokens),
                                            ("--top-p", options.top_p))
                   if value is not None and value is not False]
        if running:
            raise UsageError(f"{', '.join(running)}: only for running a cell; %%lmprogram "
                             f"{name}(...) defines a program; pass options to {name}.run(...)")
    return ProgramLine(capture, name, signature, options)
