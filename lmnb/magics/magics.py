"""`%lmnb` manages the kernel's runtime; `%%lmprogram` runs a cell as an lmnb program or defines
one. Options are traitlets: `%config LMNB` lists them, `%config LMNB.temperature = 0` sets one."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from traitlets import Bool, Float, Int, TraitError, Unicode, validate

from lmnb.lang.program import Program, set_default_backend
from lmnb.magics.abort import abort_and_settle
from lmnb.magics.cell import CELL_FUNCTION, CellNamespace, CellSource, SignatureError, compile_cell
from lmnb.magics.errors import LMProgramError
from lmnb.magics.execution import run_background, run_foreground, run_streaming
from lmnb.magics.loading import describe
from lmnb.magics.parsing import (
    HelpShown,
    ProgramLine,
    full_help,
    lmnb_parser,
    lmprogram_parser,
    parse_program_line,
)
from lmnb.magics.result import ProgramResult
from lmnb.magics.session import KernelSession
from lmnb.magics.status import LiveView, status_views
from lmnb.magics.token_run import run_with_tokens
from lmnb.params import PARAM_HELP, default_sampling_params


def _gen_default_help(name: str) -> str:
    default = default_sampling_params()[name]
    return (f"Default {name} of a cell's gens ({PARAM_HELP[name]}); None is lmnb's default "
            f"({default!r}).")


@magics_class
class LMNB(Magics):
    """lmnb's magics and their options (`%config LMNB.<option> = value`)."""

    model = Unicode(None, allow_none=True, help="Model for `%lmnb load` without MODEL and for "
                    "the first cell run with no runtime loaded; None is the embedded "
                    "SmolLM2-135M-Instruct.").tag(config=True)
    dtype = Unicode("auto", help="auto, float32, float16 or bfloat16.").tag(config=True)
    device = Unicode("auto", help="auto (CUDA when available), cpu, cuda, ...").tag(config=True)
    max_total_tokens = Int(None, allow_none=True, help="KV cache size in tokens; None sizes it "
                           "from free memory.").tag(config=True)
    temperature = Float(None, allow_none=True, help=_gen_default_help("temperature")
                        ).tag(config=True)
    max_new_tokens = Int(None, allow_none=True, help=_gen_default_help("max_new_tokens")
                         ).tag(config=True)
    top_p = Float(None, allow_none=True, help=_gen_default_help("top_p")).tag(config=True)
    stream = Bool(False, help="Stream cells by default (a live view while they "
                  "generate).").tag(config=True)
    stream_hz = Float(15.0, help="Refresh rate of the live text view (1-60).").tag(config=True)
    progress = Bool(True, help="Show a progress bar while a model loads.").tag(config=True)

    @validate("stream_hz")
    def _valid_hz(self, proposal: dict[str, Any]) -> float:
        if not 1.0 <= proposal["value"] <= 60.0:
            raise TraitError(f"stream_hz must be in [1, 60], got {proposal['value']}")
        return proposal["value"]

    def __init__(self, shell: Any) -> None:
        super().__init__(shell=shell)
        self.session = KernelSession(self.load_options)
        self._lmnb_parser = lmnb_parser()
        self._program_parser = lmprogram_parser()
        self._live_views: dict[str, list[LiveView]] = {}  # the last views of each %lmnb command

    def load_options(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "device": self.device,
                "max_total_tokens": self.max_total_tokens, "progress": self.progress}

    # ---- %lmnb -------------------------------------------------------------------------------
    @line_magic
    def lmnb(self, line: str) -> Any:
        try:
            args = self._lmnb_parser.parse_args(shlex.split(line))
        except HelpShown:
            return None
        except ValueError as error:  # shlex: unbalanced quotes
            raise UsageError(f"%lmnb: {error}") from None
        commands: dict[str, Callable[[argparse.Namespace], Any]] = {
            "load": self._load, "status": self._status, "media": self._media,
            "flush": self._flush, "close": self._close, "serve": self._serve, "help": self._help}
        return commands[args.command or "help"](args)

    def _load(self, args: argparse.Namespace) -> None:
        options = self.load_options()
        model = args.model if args.model is not None else options.pop("model")
        options.pop("model", None)
        for key in ("dtype", "device", "max_total_tokens", "schedule_policy", "sampling_defaults"):
            if getattr(args, key) is not None:
                options[key] = getattr(args, key)
        if args.disable_radix_cache:
            options["disable_radix_cache"] = True
        if args.enable_hierarchical_cache or args.hicache_storage_dir:
            options["enable_hierarchical_cache"] = True
        if args.hicache_ratio is not None:
            options["hicache_ratio"] = args.hicache_ratio
        if args.hicache_storage_dir:
            options.update(hicache_storage_backend="file",
                           hicache_storage_dir=args.hicache_storage_dir)
        try:
            runtime = self.session.load(model, **options)
        except FileNotFoundError as error:  # a path that names no model: no long traceback
            raise UsageError(f"%lmnb load: {error}") from None
        set_default_backend(self.session.backend)
        print(f"lmnb: loaded {describe(runtime)}")

    def _status(self, args: argparse.Namespace) -> Any:
        runtime = self.session.runtime
        if runtime is None:
            print("lmnb: no runtime loaded; `%lmnb load [MODEL]` loads one")
            return None
        from IPython.display import display

        *shown, returned = status_views(runtime, describe(runtime))
        self._replace_live_views("status", [*shown, returned])
        for view in shown:
            display(view)
        return returned

    def _media(self, args: argparse.Namespace) -> Any:
        runtime = self.session.runtime
        if runtime is None:
            print("lmnb: no runtime loaded; `%lmnb load [MODEL]` loads one")
            return None
        from lmnb.widgets import MediaReuseView

        view = MediaReuseView(runtime)
        self._replace_live_views("media", [view])
        return view

    def _replace_live_views(self, command: str, views: list[Any]) -> None:
        """The views of the last `%lmnb <command>` stop polling (they keep what they show): the
        new ones poll instead, so repeating a command does not add pollers of the runtime."""
        for view in self._live_views.pop(command, []):
            view.stop_polling(f"stopped: a later %lmnb {command} is live")
        self._live_views[command] = [view for view in views if isinstance(view, LiveView)]

    def _flush(self, args: argparse.Namespace) -> None:
        runtime = self.session.runtime
        if runtime is None:
            print("lmnb: no runtime loaded")
        elif runtime.flush_cache():
            print("lmnb: prefix cache flushed")
        else:
            print("lmnb: requests are running; the cache was not flushed (try again later)")

    def _close(self, args: argparse.Namespace) -> None:
        print("lmnb: runtime closed" if self.session.close() else "lmnb: no runtime loaded")

    def _serve(self, args: argparse.Namespace) -> Any:
        """`server = %lmnb serve` keeps the handle (`server.url`, `server.stop()`)."""
        if args.action == "stop":
            stopped = self.session.stop_server()
            print("lmnb: server stopped" if stopped else "lmnb: no server running")
            return None
        try:
            server = self.session.serve(host=args.host, port=args.port, api_key=args.api_key,
                                        max_request_bytes=args.max_request_bytes)
        except ImportError as error:
            raise UsageError(f"%lmnb serve needs the server extra (pip install "
                             f"'lmnb[server]'): {error}") from None
        except (OSError, ValueError) as error:  # the port is taken, a bad option
            raise UsageError(f"%lmnb serve: {error}") from None
        print(f"lmnb: serving {server.runtime.model_dir.name} at {server.url} "
              f"(OpenAI API: {server.url}/v1); `%lmnb serve stop` stops it")
        return server

    def _help(self, args: argparse.Namespace) -> None:
        print(full_help(self._lmnb_parser))
        print(self._program_parser.format_help())

    # ---- %%lmprogram -------------------------------------------------------------------------
    @line_cell_magic
    def lmprogram(self, line: str, cell: str | None = None) -> Any:
        try:
            parsed = parse_program_line(line, self._program_parser)
        except HelpShown:
            return None
        if cell is None:  # only `%lmprogram --help` makes sense as a line magic
            raise UsageError("%%lmprogram runs the cell below it; `%lmprogram --help` for usage")
        name = parsed.name or CELL_FUNCTION
        filename = f"<lmprogram {parsed.name}>" if parsed.name else "<lmprogram cell>"
        source = CellSource.of(filename, f"%%lmprogram {line}".rstrip(), cell)
        try:
            func = compile_cell(source, namespace=CellNamespace(self.shell.user_ns), name=name,
                                signature=parsed.signature)
        except SignatureError as error:
            raise UsageError(str(error)) from None
        except Exception as error:  # a syntax error, or a default that does not evaluate
            raise LMProgramError(error, source) from error
        if parsed.name is not None:
            program = Program(func)
            self.shell.user_ns[parsed.name] = program
            if parsed.options.trace:
                self._print_trace(program, source)
            return None
        if parsed.options.trace:
            self._print_trace(Program(func), source)
            return None
        return self._run(func, parsed, source)

    def _print_trace(self, program: Program, source: CellSource) -> None:
        try:
            traced = program.trace()
        except Exception as error:
            raise LMProgramError(error, source) from error
        print(traced)

    def _sampling(self, options: argparse.Namespace) -> dict[str, Any]:
        sampling = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
                    "top_p": self.top_p}
        for key in sampling:
            if getattr(options, key) is not None:
                sampling[key] = getattr(options, key)
        return {key: value for key, value in sampling.items() if value is not None}

    def _run(self, func: Any, parsed: ProgramLine, source: CellSource) -> Any:
        options = parsed.options
        backend = self.session.local_backend()
        sampling = self._sampling(options)
        stream = self.stream if options.stream is None else options.stream
        if options.tokens:
            result = run_with_tokens(func, backend, {**sampling, "token_view": True},
                                     background=options.bg)
            if not options.bg:
                self._raise_failure(result, source)
        elif options.bg:
            result = run_background(func, backend, sampling, live=stream)
        else:
            if stream:
                result = run_streaming(func, backend, sampling, hz=self.stream_hz)
            else:
                result = run_foreground(func, backend, sampling)
            self._raise_failure(result, source)
        if parsed.capture is not None:
            self.shell.user_ns[parsed.capture] = result
            return None
        return result

    def _raise_failure(self, result: ProgramResult, source: CellSource) -> None:
        """Raises the failed cell's error once every request of its run (forks included) has
        stopped."""
        if (error := result.state.error()) is None:
            return
        abort_and_settle(result.state)
        raise LMProgramError(error, source, hint=self._failed_runtime_hint()) from error

    def _failed_runtime_hint(self) -> str | None:
        runtime = self.session.runtime
        if runtime is None or not runtime.failed:
            return None
        return ("hint: the runtime has failed and refuses every request; `%lmnb load [MODEL]` "
                "loads a new one")


LMNB.lmnb.__doc__ = full_help(lmnb_parser())
LMNB.lmprogram.__doc__ = lmprogram_parser().format_help()
