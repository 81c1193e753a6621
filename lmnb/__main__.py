"""`python -m lmnb serve [MODEL] [--host H] [--port N] [--api-key KEY] ...`: load a model and
serve it (OpenAI, SGLang native, Anthropic and Ollama APIs) until interrupted."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lmnb")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF folder or GGUF file; default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-total-tokens", type=int, default=None)
    serve.add_argument("--log-level", default="info")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lmnb.runtime.engine import Runtime
    from lmnb.server import serve

    options = {"device": args.device, "dtype": args.dtype}
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    with Runtime(args.model, **options) as runtime:
        serve(runtime, host=args.host, port=args.port, api_key=args.api_key,
              served_model_name=args.served_model_name, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
