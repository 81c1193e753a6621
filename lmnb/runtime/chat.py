"""Chat messages to prompt text with the tokenizer's own (jinja) chat template.

The text is what `Runtime.generate(prompt)` should be given: when the tokenizer adds BOS while
encoding, a BOS that the template writes at the start is dropped, so it is not doubled.

Tools: OpenAI-shaped `tools` ([{"type": "function", "function": {name, description,
parameters}}]) and messages carrying them (an assistant's `tool_calls`, `tool` messages) go to a
template that renders tools as they are (the call arguments parsed from their JSON text, as
templates expect a mapping). A template that ignores tools (SmolLM2's) gets lmnb's default,
Hermes-style format instead: the tools as JSON in the system prompt, each call written as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, tool results in a user turn
within `<tool_response>` tags.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from lmnb.runtime.core import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool")

# The default tool-call format (a template without tools of its own): what the system prompt asks
# for, how history renders, and what the server constrains and parses.
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
TOOL_CALL_SEPARATOR = "\n"
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
_TOOLS_PROMPT = """\
You can call functions to help with the request. Their signatures, as JSON, are within \
<tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and its arguments within \
<tool_call></tool_call> tags, one call per pair of tags:
<tool_call>
{{"name": <function name>, "arguments": <the arguments as a JSON object>}}
</tool_call>
The results come back within <tool_response></tool_response> tags."""

_PROBE_TOOL = {"type": "function", "function": {
    "name": "lmnb_probe_tool_3f9c", "description": "",
    "parameters": {"type": "object", "properties": {}}}}
_renders_tools: dict[str, bool] = {}  # chat template text -> whether it writes the tools


class ChatTokenizer(Protocol):
    """What rendering chats takes of a tokenizer (transformers' tokenizers have all of it)."""

    chat_template: str | dict[str, str] | None  # jinja text, or named templates
    bos_token: str | None
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def _check_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError(f"message {i} must be a dict with a 'role', got {message!r}")
        if message["role"] not in _ROLES:
            raise InvalidRequestError(f"message {i} has an unknown role {message['role']!r}; "
                                      f"use one of {_ROLES}")
    return [dict(message) for message in messages]


def adds_bos(tokenizer: ChatTokenizer) -> bool:
    """Whether encoding a text (special tokens added) starts it with the BOS token."""
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def strip_added_bos(tokenizer: ChatTokenizer, text: str) -> str:
    """`text` without a leading BOS token text when encoding adds BOS anyway."""
    bos = tokenizer.bos_token
    if not bos or not text.startswith(bos):
        return text
    return text[len(bos):] if adds_bos(tokenizer) else text


def renders_tools(tokenizer: ChatTokenizer) -> bool:
    """Whether the tokenizer's chat template writes the `tools` it is given (cached per
    template text)."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    known = _renders_tools.get(template)
    if known is None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                 tools=[_PROBE_TOOL], tokenize=False,
                                                 add_generation_prompt=True)
            known = _PROBE_TOOL["function"]["name"] in text
        except Exception:  # a template that fails on tools has no tool support
            known = False
        _renders_tools[template] = known
    return known


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the default format."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE


def _calls_of(message: dict[str, Any], i: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of an assistant message's `tool_calls` (OpenAI's shape, arguments a
    JSON text or a mapping)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InvalidRequestError(f"message {i}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError(f"message {i}: tool_calls[{j}] needs function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise InvalidRequestError(f"message {i}: tool_calls[{j}].function.arguments is "
                                          f"not valid JSON: {error}") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"message {i}: tool_calls[{j}].function.arguments must "
                                      "be a JSON object")
        out.append((name, arguments))
    return out


def _with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with tool support: call arguments as mappings."""
    out = []
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            calls = _calls_of(message, i)
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": arguments}}
                for call, (_, arguments) in zip(message["tool_calls"], calls, strict=True)]}
        out.append(message)
    return out


def _content_text(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"message {i}: content must be text in a conversation with "
                                  "tool calls")
    return content


Content = str | list[dict[str, Any]]  # text, or content parts (text, image, video)


def _response(message: dict[str, Any], i: int) -> Content:
    """A tool result in its tags: text, or parts when it has images (a multimodal template's
    `{"type": "image"}` parts)."""
    content = message.get("content")
    if not isinstance(content, list):
        return _RESPONSE_OPEN + _content_text(message, i) + _RESPONSE_CLOSE
    if not all(isinstance(part, dict) and "type" in part for part in content):
        raise InvalidRequestError(f"message {i}: content must be text or a list of parts "
                                  "with a 'type'")
    return [_text_part(_RESPONSE_OPEN), *content, _text_part(_RESPONSE_CLOSE)]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _parts(content: Content) -> list[dict[str, Any]]:
    return [_text_part(content)] if isinstance(content, str) else content


def _joined(first: Content, second: Content) -> Content:
    """Two tool results of one turn, a line apart."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n" + second
    return [*_parts(first), _text_part("\n"), *_parts(second)]


def _in_default_format(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls and results as text of the default format (results with images as parts);
    consecutive `tool` messages become one user turn."""
    out: list[dict[str, Any]] = []
    responses = False  # whether out[-1] is a turn of tool results
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            response = _response(message, i)
            if responses:
                out[-1]["content"] = _joined(out[-1]["content"], response)
            else:
                out.append({"role": "user", "content": response})
        elif role == "assistant" and message.get("tool_calls"):
            calls = TOOL_CALL_SEPARATOR.join(tool_call_text(name, arguments)
                                             for name, arguments in _calls_of(message, i))
            content = _content_text(message, i)
            out.append({"role": "assistant", "content": (content + "\n" if content else "")
                        + calls})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
        responses = role == "tool"
    return out


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = _TOOLS_PROMPT.format(tools=listing)
    first = messages[0]
    if first["role"] == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": first["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _template_variables(tokenizer: ChatTokenizer,
                        variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """`variables` for the template, none of them one of the renderer's own arguments."""
    if not variables:
        return {}
    own = inspect.signature(tokenizer.apply_chat_template).parameters
    taken = sorted(name for name in variables if name in own or not isinstance(name, str))
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(map(str, taken))}"
                                  ": the renderer's own arguments", param="chat_template_kwargs")
    return dict(variables)


def apply_chat_template(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], *,
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]) in the tokenizer's
    template; with `add_generation_prompt`, followed by the opening of an assistant turn.
    `tools` and tool calls in the messages are rendered as the module docstring says;
    `template_kwargs` are more variables of the template (SGLang's and vLLM's
    `chat_template_kwargs`, e.g. `enable_thinking`). Raises `InvalidRequestError` when the
    tokenizer has no template or the template rejects the messages (e.g. roles that do not
    alternate)."""
    if not tokenizer.chat_template:
        raise InvalidRequestError("the tokenizer has no chat template; format the prompt "
                                  "yourself or load a model whose tokenizer has one")
    variables = _template_variables(tokenizer, template_kwargs)
    checked = _check_messages(messages)
    has_calls = any(m["role"] == "tool" or m.get("tool_calls") for m in checked)
    if tools or has_calls:
        if renders_tools(tokenizer):
            checked = _with_parsed_arguments(checked)
        else:
            checked = _in_default_format(checked)
            if tools:
                checked = _with_tools_prompt(checked, tools)
            tools = None
    try:
        text = tokenizer.apply_chat_template(checked, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **variables)
    except Exception as error:  # jinja's TemplateError (raise_exception in templates) and kin
        raise InvalidRequestError(f"the chat template rejected the messages: {error}") from None
    return strip_added_bos(tokenizer, text)
