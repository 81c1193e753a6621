"""The `Backend` protocol (`lmnb.lang.backends.base`): `LocalBackend`, `RuntimeEndpoint` and
`OpenAI` implement it, checked on the classes (each protocol parameter with its kind and default;
anything more optional) and, through `isinstance`, on instances (live `LocalBackend` and
`RuntimeEndpoint` instances are checked in test_openai_backend_server.py and
test_sglang_compat.py, where they exist anyway)."""

from __future__ import annotations

import inspect

import pytest

from lmnb.lang.backends.base import Backend, BaseBackend, MediaUnsupported
from lmnb.lang.backends.endpoint import RuntimeEndpoint
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.backends.openai import OpenAI

BACKENDS = [LocalBackend, RuntimeEndpoint, OpenAI]


def _members(protocol: type) -> tuple[dict[str, inspect.Signature], list[str]]:
    methods = {name: inspect.signature(member) for name, member in vars(protocol).items()
               if inspect.isfunction(member) and not name.startswith("_")}
    return methods, list(protocol.__annotations__)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_backend_class_matches_the_protocol(cls: type) -> None:
    methods, attributes = _members(Backend)
    assert {"generate", "select", "cache_prefix", "prepare_media"} <= set(methods)
    assert {"chat_template", "is_chat_model", "reports_token_texts"} <= set(attributes)
    for name, expected in methods.items():
        got = inspect.signature(getattr(cls, name))
        for param in expected.parameters.values():
            assert param.name in got.parameters, f"{cls.__name__}.{name} lacks {param.name}"
            actual = got.parameters[param.name]
            assert (actual.kind, actual.default) == (param.kind, param.default), \
                f"{cls.__name__}.{name}({param.name})"
        extra = [p.name for p in got.parameters.values() if p.name not in expected.parameters
                 and (p.default is inspect.Parameter.empty or p.kind is not p.KEYWORD_ONLY)]
        assert not extra, f"{cls.__name__}.{name} takes {extra} beyond the protocol"
    source = inspect.getsource(cls)
    for name in attributes:
        assert hasattr(cls, name) or f"self.{name} =" in source, f"{cls.__name__}: {name}"


def test_instances_satisfy_the_protocol() -> None:
    chat: Backend = OpenAI("m", client=object())
    completion: Backend = OpenAI("gpt-3.5-turbo-instruct", client=object())
    assert isinstance(chat, Backend) and chat.is_chat_model and chat.reports_token_texts
    assert isinstance(completion, Backend) and not completion.is_chat_model
    with pytest.raises(MediaUnsupported, match="sends text only"):  # no images over the API
        chat.prepare_media("image", "cat.png")
    # SGLang-style custom backends are run through their own hooks, not this protocol; they
    # still say whether they are chat models, and take no media.
    custom = BaseBackend()
    assert custom.is_chat_model is False and custom.reports_token_texts is False
    with pytest.raises(MediaUnsupported, match="custom backend"):
        custom.prepare_media("video", "clip.mp4", num_frames=4)
