"""Tool calling, one definition for OpenAI's, Anthropic's and Ollama's routes: the request's
tools and tool choice, the model's call format, the regex every call is generated under, and the
parser of generated calls.

A call region is text in the model's format, e.g. (Hermes/Qwen, the default)
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` repeated with "\\n" between
calls, or (Llama-3 JSON) `{"name": "f", "parameters": {...}}` repeated with "; ". Its regex is
written from each function's parameters schema (`json_schema_to_regex`, canonical JSON layout), so
a generated region always parses into calls of offered functions whose arguments are valid for
their schemas (unless `max_tokens` cuts it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lmnb.runtime.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_CALL_SEPARATOR,
    renders_tools,
)
from lmnb.runtime.fsm.json_schema import InvalidSchemaError, json_schema_to_regex
from lmnb.runtime.fsm.regex_text import alternatives, literal_text
from lmnb.server.errors import APIError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DECODER = json.JSONDecoder()
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; `parameters` is a JSON schema of an object."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape, which chat templates take."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def _tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not name:
        raise APIError(f"{where}: a tool needs a non-empty string name", param="tools")
    if parameters is None:
        parameters = _NO_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise APIError(f"{where}: the parameters of tool {name!r} must be a JSON schema of an "
                       "object", param="tools")
    return Tool(name, description if isinstance(description, str) else "", parameters)


def _unique(tools: list[Tool]) -> list[Tool]:
    names = [t.name for t in tools]
    for name in names:
        if names.count(name) > 1:
            raise APIError(f"tools: the name {name!r} is given twice", param="tools")
    return tools


def openai_tools(value: list[dict[str, Any]] | None) -> list[Tool]:
    """`tools` of a chat completion request."""
    tools = []
    for i, entry in enumerate(value or []):
        where = f"tools.{i}"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function":
            raise APIError(f"{where}: only tools of type 'function' are supported",
                           param="tools")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}: function must be an object", param="tools")
        tools.append(_tool(function.get("name"), function.get("description"),
                           function.get("parameters"), where))
    return _unique(tools)


def anthropic_tools(value: list[dict[str, Any]] | None) -> list[Tool]:
    """`tools` of a Messages request (custom tools; Anthropic's server tools are refused)."""
    tools = []
    for i, entry in enumerate(value or []):
        where = f"tools.{i}"
        if not isinstance(entry, dict) or entry.get("type", "custom") != "custom":
            kind = entry.get("type") if isinstance(entry, dict) else entry
            raise APIError(f"{where}: tools of type {kind!r} are not supported; only custom "
                           "tools (name, description, input_schema)", param="tools")
        tools.append(_tool(entry.get("name"), entry.get("description"),
                           entry.get("input_schema"), where))
    return _unique(tools)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`none`: no calls; `auto`: the model decides; `required`: at least one call, of `name`
    only when it is set. `parallel`: several calls may follow each other."""

    mode: Literal["none", "auto", "required"]
    name: str | None = None
    parallel: bool = True


def _named(name: Any, tools: list[Tool], param: str) -> str:
    if not any(t.name == name for t in tools):
        raise APIError(f"{param}: the function {name!r} is not one of the tools "
                       f"{[t.name for t in tools]}", param=param)
    return name


def openai_tool_choice(value: Any, parallel: bool | None, tools: list[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice` ("none", "auto", "required" or {"type": "function", "function":
    {"name": ...}}; "auto" by default when there are tools) and `parallel_tool_calls`."""
    parallel = True if parallel is None else parallel
    if value is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(value, parallel=parallel)
    function = value.get("function") if isinstance(value, dict) else None
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(function, dict)):
        return ToolChoice("required", _named(function.get("name"), tools, "tool_choice"),
                          parallel)
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {value!r}", param="tool_choice")


def anthropic_tool_choice(value: dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    """Anthropic's `tool_choice`: {"type": "auto" | "any" | "tool" | "none", "name",
    "disable_parallel_tool_use"}; "auto" by default."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not (isinstance(value, dict) and value.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return ToolChoice(kind, parallel=parallel)
    if kind in ("any", "tool") and not tools:
        raise APIError(f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool":
        return ToolChoice("required", _named(value.get("name"), tools, "tool_choice"), parallel)
    raise APIError("tool_choice.type must be 'auto', 'any', 'tool' or 'none', got "
                   f"{value!r}", param="tool_choice")


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model writes calls: each is `open + {"name": ..., KEY: {...}} + close`, calls are
    joined by `separator`. `marker` (a prefix of the first call's text) is what starts calls
    in free text; with `leading_only` only at the start of the output (after whitespace)."""

    open: str
    close: str
    separator: str
    arguments_key: str
    marker: str
    leading_only: bool

    @property
    def head(self) -> str:
        """The text every call starts with, up to its name."""
        return self.open + '{"name": '


HERMES = CallFormat(open=TOOL_CALL_OPEN, close=TOOL_CALL_CLOSE, separator=TOOL_CALL_SEPARATOR,
                    arguments_key="arguments", marker=TOOL_CALL_OPEN.strip(),
                    leading_only=False)
LLAMA3_JSON = CallFormat(open="", close="", separator="; ", arguments_key="parameters",
                         marker="{", leading_only=True)


def call_format(tokenizer: PreTrainedTokenizerBase) -> CallFormat:
    """The format the model's template teaches: Llama-3's JSON when the template writes tools
    and asks for `"parameters"` (and has no `<tool_call>`); Hermes otherwise, which is also the
    format `lmnb.runtime.chat` prompts for when the template has no tools of its own."""
    template = tokenizer.chat_template
    if (isinstance(template, str) and renders_tools(tokenizer) and HERMES.marker not in template
            and '"parameters"' in template):
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, choice and format, with the regexes its calls are generated under:
    `calls_regex` matches a whole call region, `rest_regex` what follows the format's marker."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    format: CallFormat
    calls_regex: str = field(init=False)
    rest_regex: str = field(init=False)

    def __post_init__(self) -> None:
        fmt = self.format
        callable_ = [t for t in self.tools if self.choice.name in (None, t.name)]
        tails = alternatives([self._tail(t) for t in callable_])
        assert tails is not None and fmt.head.startswith(fmt.marker)
        one = literal_text(fmt.head) + tails
        more = f"({literal_text(fmt.separator)}{one})*" if self.choice.parallel else ""
        object.__setattr__(self, "calls_regex", one + more)
        object.__setattr__(self, "rest_regex",
                           literal_text(fmt.head[len(fmt.marker):]) + tails + more)

    def _tail(self, tool: Tool) -> str:
        """`"name", KEY: ARGS}` + close, as a regex."""
        try:
            arguments = json_schema_to_regex(tool.parameters)
        except (InvalidSchemaError, ValueError) as error:
            raise APIError(f"tools: the parameters schema of {tool.name!r} cannot be used: "
                           f"{error}", param="tools") from None
        name = json.dumps(tool.name, ensure_ascii=False)
        return (literal_text(f'{name}, "{self.format.arguments_key}": ') + arguments
                + literal_text("}" + self.format.close))

    @property
    def forced(self) -> bool:
        return self.choice.mode == "required"

    def prompt_tools(self) -> list[dict[str, Any]]:
        """The tools for the chat template (OpenAI's shape)."""
        return [t.openai() for t in self.tools]


def tool_plan(tools: list[Tool], choice: ToolChoice,
              tokenizer: PreTrainedTokenizerBase) -> ToolPlan | None:
    """The plan of a request, or None when it makes no calls (no tools, or `none`)."""
    if not tools or choice.mode == "none":
        return None
    return ToolPlan(tuple(tools), choice, call_format(tokenizer))


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object; a prefix of it while `complete` is False
    complete: bool


def parse_calls(region: str, fmt: CallFormat) -> list[ParsedCall]:
    """The calls in a (possibly unfinished) call region: every call whose name is complete, the
    last one with the arguments text so far. Text past the last call that the format does not
    allow (only possible in a cut region) is ignored."""
    calls: list[ParsedCall] = []
    key = f', "{fmt.arguments_key}": '
    pos = 0
    while pos < len(region):
        head = (fmt.separator if calls else "") + fmt.head
        if not region.startswith(head, pos):
            break
        try:
            name, pos = _DECODER.raw_decode(region, pos + len(head))
        except json.JSONDecodeError:
            break
        if not isinstance(name, str):
            break
        if not region.startswith(key, pos):
            calls.append(ParsedCall(name, "", False))
            break
        start = pos + len(key)
        try:
            _, end = _DECODER.raw_decode(region, start)
        except json.JSONDecodeError:
            calls.append(ParsedCall(name, region[start:], False))
            break
        complete = region.startswith("}" + fmt.close, end)
        calls.append(ParsedCall(name, region[start:end], complete))
        if not complete:
            break
        pos = end + 1 + len(fmt.close)
    return calls


_SCALAR = re.compile(r"true|false|null|-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def partial_object(text: str) -> dict[str, Any]:
    """A cut call's arguments (a prefix of a JSON object) as clients' partial JSON parsers
    read them (the `anthropic` SDK's, of streamed `input_json_delta`s): the whole members so
    far, open arrays and objects closed; a value cut short (a string, a literal, a number not
    yet a number) is left out with its key."""
    closers: list[str] = []
    best = ""  # the longest prefix that closes into a whole value, closed
    i = 0
    while i < len(text):
        ch = text[i]
        whole = True
        if ch in "{[":
            closers.append("}" if ch == "{" else "]")
            i += 1
        elif ch in "}]":
            closers.pop()
            i += 1
        elif ch == '"':
            try:
                _, end = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            before = text[:i].rstrip()[-1:]
            whole = not (closers[-1] == "}" and before in ("{", ","))  # a key is not a value
            i = end
        elif ch in ",: \n\t":
            i += 1
            continue
        else:
            match = _SCALAR.match(text, i)
            if match is None or (match.end() < len(text)
                                 and text[match.end()] not in ",}] \n\t"):
                break
            i = match.end()
        if whole:
            best = text[:i] + "".join(reversed(closers))
    return json.loads(best) if best else {}


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's place among the choice's calls
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


class CallStream:
    """A choice's call region read incrementally: `feed(delta)` gives the new call starts and
    argument fragments, in order; their concatenation is `parse_calls` of the whole region."""

    def __init__(self, fmt: CallFormat) -> None:
        self.format = fmt
        self.region = ""
        self.calls: list[ParsedCall] = []
        self._sent: list[int] = []  # argument characters given out, per call

    def feed(self, delta: str) -> list[CallStart | ArgumentsDelta]:
        if not delta:
            return []
        self.region += delta
        self.calls = parse_calls(self.region, self.format)
        events: list[CallStart | ArgumentsDelta] = []
        for i, call in enumerate(self.calls):
            if i == len(self._sent):
                self._sent.append(0)
                events.append(CallStart(i, call.name))
            if len(call.arguments) > self._sent[i]:
                events.append(ArgumentsDelta(i, call.arguments[self._sent[i]:]))
                self._sent[i] = len(call.arguments)
        return events
