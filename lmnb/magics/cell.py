"""A `%%lmprogram` cell body compiled into a program function.

The body becomes `def NAME(s, ARGS): BODY`, built from the body's own syntax tree (strings are not
re-indented) with line numbers shifted to the cell's: the magic line is line 1, the body starts at
line 2. The function's globals are a `CellNamespace`: a name resolves in the notebook's namespace
first, then among the DSL names (`gen`, `select`, roles, ...), then in builtins. A notebook
variable named like a DSL name shadows it inside cells and is never overwritten. Assignments in the
body are local to the program, as in a function; a name the body declares `global` is the
notebook's, as in any cell: the body reads its own writes back, and they reach the notebook's
namespace once the body has run.
"""

from __future__ import annotations

import ast
import builtins
import functools
import linecache
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DSL_NAMES = ("gen", "gen_int", "gen_string", "select", "image", "video", "system", "user",
             "assistant", "system_begin", "system_end", "user_begin", "user_end",
             "assistant_begin", "assistant_end", "separate_reasoning", "function")
CELL_FUNCTION = "__cell__"


class CellSyntaxError(SyntaxError):
    """The cell body does not parse; `lineno` is the cell's line."""


class SignatureError(ValueError):
    """`%%lmprogram name(...)` names parameters that do not parse."""


def dsl_namespace() -> dict[str, Any]:
    import lmnb

    return {"lmnb": lmnb, **{name: getattr(lmnb, name) for name in DSL_NAMES}}


class CellNamespace(dict):
    """Globals of a cell program. CPython reads a non-exact dict's globals through `__getitem__`,
    so the notebook's names stay live; the dict's own items (the DSL names and `__builtins__`) are
    the fallback and also serve CPython's raw lookups. A `global x` write goes into the dict
    (CPython's STORE_GLOBAL skips `__setitem__`): it is read first, and `publish()` moves it into
    the notebook's namespace."""

    def __init__(self, user_ns: dict[str, Any]) -> None:
        fallbacks = {**dsl_namespace(), "__builtins__": user_ns.get("__builtins__", builtins),
                     "__name__": user_ns.get("__name__", "__main__")}
        super().__init__(fallbacks)
        self.user_ns = user_ns
        self._fallbacks = fallbacks

    def _set_by_cell(self, key: str) -> bool:
        if not dict.__contains__(self, key):
            return False
        fallback = self._fallbacks.get(key, _NONE)
        return dict.__getitem__(self, key) is not fallback

    def __getitem__(self, key: str) -> Any:
        if self._set_by_cell(key):
            return dict.__getitem__(self, key)
        try:
            return self.user_ns[key]
        except KeyError:
            return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.user_ns or dict.__contains__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def publish(self) -> None:
        """Moves the names the cell set (`global x; x = ...`) into the notebook's namespace."""
        for key in [k for k in dict.keys(self) if self._set_by_cell(k)]:
            self.user_ns[key] = dict.pop(self, key)
            if key in self._fallbacks:
                dict.__setitem__(self, key, self._fallbacks[key])


_NONE = object()


@dataclass(frozen=True)
class CellSource:
    """The cell's text as compiled: `lines[0]` is the magic line, the body follows."""

    filename: str
    lines: tuple[str, ...]

    @classmethod
    def of(cls, filename: str, magic_line: str, body: str) -> CellSource:
        return cls(filename, tuple(f"{magic_line}\n{body}".splitlines(keepends=True)))

    @property
    def body(self) -> str:
        return "".join(self.lines[1:])

    def register(self) -> None:
        """Makes ordinary tracebacks (e.g. of a named program run later) show the cell's lines."""
        text = "".join(self.lines)
        linecache.cache[self.filename] = (len(text), None, list(self.lines), self.filename)

    def line(self, lineno: int | None) -> str | None:
        if lineno is None or not 1 <= lineno <= len(self.lines):
            return None
        return self.lines[lineno - 1].rstrip("\n")


def _header(name: str, signature: str) -> ast.FunctionDef:
    params = signature.strip()
    try:
        first = ast.parse(f"def _({params}): pass").body[0].args if params else None
    except SyntaxError:
        raise SignatureError(f"bad program signature {name}({signature})") from None
    has_state = first is not None and [a.arg for a in first.posonlyargs + first.args][:1] == ["s"]
    if not has_state:
        params = f"s, {params}" if params else "s"
    return ast.parse(f"def {name}({params}):\n    pass").body[0]


def compile_cell(source: CellSource, *, namespace: CellNamespace, name: str = CELL_FUNCTION,
                 signature: str = "") -> Callable[..., Any]:
    """`def name(s, signature): body` with the cell's line numbers; defaults are evaluated now.
    Raises `CellSyntaxError` (cell line numbers) or `SignatureError`."""
    source.register()
    try:
        tree = ast.parse(source.body, filename=source.filename)
    except SyntaxError as error:
        lineno = error.lineno + 1 if error.lineno is not None else None
        raise CellSyntaxError(error.msg, (source.filename, lineno, error.offset,
                                          source.line(lineno), None, None)) from None
    ast.increment_lineno(tree, 1)
    function = _header(name, signature)
    function.body = tree.body or [ast.Pass(lineno=2, col_offset=0)]
    module = ast.Module(body=[function], type_ignores=[])
    ast.fix_missing_locations(module)
    scope: ChainMap = ChainMap({}, namespace)  # `def` binds in the fresh first map only
    exec(compile(module, source.filename, "exec"), namespace, scope)
    func = scope.maps[0][name]
    if not any(isinstance(node, ast.Global) for node in ast.walk(tree)):
        return func

    @functools.wraps(func)
    def publishing(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        finally:
            namespace.publish()

    return publishing
