"""`python -m lmnb serve [MODEL] [--host H] [--port N] [--api-key KEY] ...`: load a model and
serve it (OpenAI, SGLang native, Anthropic and Ollama APIs) until interrupted.

With `--watch-stdin` (how a data-parallel router runs its replicas) it prints "lmnb: serving on
URL" on stdout once serving (`--port 0`: a free port) and stops when stdin closes (its parent
died or let go: no orphan replicas). `--engine-options JSON` passes any `Runtime` option."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def origins(value: str) -> list[str]:
    """`--allowed-origins`: `a,b` or vLLM's JSON list `["a", "b"]`."""
    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {value!r}")
        return parsed
    return [origin.strip() for origin in value.split(",") if origin.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lmnb")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF folder or GGUF file; default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    serve.add_argument("--port", type=int, default=30000, help="0: a free port")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-request-bytes", type=int, default=32 * 2**20, metavar="N",
                       help="larger request bodies are refused (HTTP 413) unread; default "
                            "32 MiB")
    serve.add_argument("--allowed-origins", type=origins, default=["*"], metavar="ORIGINS",
                       help="origins whose browser pages may call the server (CORS): comma "
                            "separated, or a JSON list as vLLM's; default * (any); '' none")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-total-tokens", type=int, default=None)
    serve.add_argument("--speculative-algorithm", default=None, choices=["NGRAM"],
                       help="speculative decoding: NGRAM drafts from the prompt and output")
    serve.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                       help="verify positions per step (the last token + N - 1 drafts)")
    serve.add_argument("--allow-auto-truncate", action="store_true",
                       help="cut max_new_tokens to the room a prompt leaves in the context "
                            "instead of refusing the request (HTTP 400)")
    serve.add_argument("--sampling-defaults", default=None, choices=["model", "openai"],
                       help="the defaults of an OpenAI request's omitted temperature, top_p, "
                            "top_k, min_p, repetition_penalty: the model's generation_config.json "
                            "(model, the default) or OpenAI's")
    serve.add_argument("--quantization", default=None, help="fp8 | compressed-tensors")
    serve.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3 | bf16")
    serve.add_argument("--engine-options", type=json.loads, default=None, metavar="JSON",
                       help="more Runtime options as a JSON object (SGLang's names)")
    serve.add_argument("--watch-stdin", action="store_true",
                       help="print the URL once serving; stop when stdin reaches end of file "
                            "(the parent process is gone)")
    serve.add_argument("--log-level", default="info")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lmnb.runtime.distributed.replica import READY_PREFIX
    from lmnb.runtime.launch import Runtime
    from lmnb.server import serve
    from lmnb.server.serving import ServerHandle

    options = {"device": args.device, "dtype": args.dtype, "quantization": args.quantization,
               "kv_cache_dtype": args.kv_cache_dtype}
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    if args.allow_auto_truncate:
        options["allow_auto_truncate"] = True
    for name in ("speculative_algorithm", "speculative_num_draft_tokens", "sampling_defaults"):
        if vars(args)[name] is not None:
            options[name] = vars(args)[name]
    options.update(args.engine_options or {})
    with Runtime(args.model, **options) as runtime:
        if not args.watch_stdin:
            serve(runtime, host=args.host, port=args.port, api_key=args.api_key,
                  served_model_name=args.served_model_name,
                  max_request_bytes=args.max_request_bytes,
                  allowed_origins=args.allowed_origins, log_level=args.log_level)
            return 0
        handle = ServerHandle.start(runtime, host=args.host, port=args.port,
                                    api_key=args.api_key,
                                    served_model_name=args.served_model_name,
                                    max_request_bytes=args.max_request_bytes,
                                    allowed_origins=args.allowed_origins,
                                    log_level="warning" if args.log_level == "info"
                                    else args.log_level)
        print(f"{READY_PREFIX}{handle.url}", flush=True)
        try:
            sys.stdin.buffer.read()  # returns at end of file: the parent closed it or died
        except KeyboardInterrupt:
            pass
        finally:
            handle.stop(timeout=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
