"""Pinned prefixes: `Runtime.pin_prefix` keeps a prefix cached under KV pressure that evicts
everything else, until `unpin_prefix`; SGLang's `Program.pin()` / `unpin()` go through it."""

from __future__ import annotations

import pytest

import lmnb as sgl
from lmnb.runtime.core import InvalidRequestError
from tests.fake_backend import TextOnlyFake

POOL = 192  # KV slots: a few prompts fill it, so every new one evicts
SHARED = "You are a careful assistant who answers questions about tea.\n" * 3


@pytest.fixture(scope="module")
def rt(tiny_models):
    with sgl.Runtime(tiny_models["llama-gqa"], max_total_tokens=POOL,
                     check_integrity_each_step=True) as runtime:
        yield runtime


def _pressure(rt, rounds: int = 8) -> None:
    """Distinct prompts whose KV together is several times the pool."""
    for i in range(rounds):
        rt.generate(f"Unrelated request number {i}: " + "lorem ipsum dolor " * 8,
                    {"max_new_tokens": 4, "temperature": 0})


def _hit(rt, prompt: str) -> int:
    return rt.generate(prompt, {"max_new_tokens": 1})["meta_info"]["cached_tokens"]


def test_a_pinned_prefix_survives_eviction_until_unpinned(rt):
    prefix_tokens = len(rt.encode(SHARED))
    rt.flush_cache()
    pin = rt.pin_prefix(SHARED)
    stats = rt.stats()
    assert stats["pinned_prefixes"] == 1 and stats["pinned_tokens"] == prefix_tokens
    assert stats["protected_tokens"] == prefix_tokens  # locked, as a running request's prefix

    evicted = rt.stats()["evicted_tokens"]
    _pressure(rt)
    assert rt.stats()["evicted_tokens"] > evicted  # the pool really was under pressure
    assert rt.flush_cache() is True  # a flush keeps pinned prefixes too
    assert rt.stats()["tree_tokens"] == prefix_tokens
    assert _hit(rt, SHARED + "Which tea is green?") >= prefix_tokens
    rt.check_integrity()

    assert rt.unpin_prefix(pin) is True and rt.unpin_prefix(pin) is False
    assert rt.stats()["pinned_tokens"] == 0
    _pressure(rt)  # the same pressure now evicts it: the least recently used run goes first
    assert _hit(rt, SHARED + "Which tea is black?") < prefix_tokens
    rt.check_integrity()


def test_pin_needs_the_radix_cache(tiny_models):
    with sgl.Runtime(tiny_models["llama-gqa"], max_total_tokens=POOL,
                     disable_radix_cache=True) as runtime:
        with pytest.raises(InvalidRequestError, match="radix"):
            runtime.pin_prefix(SHARED)


def test_program_pin_and_unpin_as_sglang(rt, monkeypatch):
    from lmnb.lang import default_backend as default_backend_module

    monkeypatch.setattr(default_backend_module, "_default_backend", None)
    sgl.set_default_backend(rt)

    @sgl.function
    def tea(s, question):
        s += SHARED
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, temperature=0)

    rt.flush_cache()
    prefix = tea.pin()
    assert prefix.startswith(SHARED) and tea.pin() == prefix  # once per backend
    assert rt.stats()["pinned_prefixes"] == 1
    _pressure(rt)
    state = tea.run(question="Green?")
    assert state.get_meta_info("answer")["cached_tokens"] >= len(rt.encode(SHARED))
    assert tea.unpin() is True and tea.unpin() is False
    assert rt.stats()["pinned_prefixes"] == 0


class _Cached(TextOnlyFake):
    """A backend with no pinning: `pin()` only caches."""

    def __init__(self) -> None:
        super().__init__()
        self.cached: list[str] = []

    def cache_prefix(self, prompt: str) -> None:
        self.cached.append(prompt)


class _Pinning(_Cached):
    """Any backend with `pin_prefix` / `unpin_prefix` (`PrefixPinning`) is pinned on."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[str] = []
        self.unpinned: list[int] = []

    def pin_prefix(self, prompt: str) -> int:
        self.pinned.append(prompt)
        return 7

    def unpin_prefix(self, pin: int) -> bool:
        self.unpinned.append(pin)
        return True


@sgl.function
def _tea(s, question):
    s += SHARED
    s += "Q: " + question + sgl.gen("answer", max_tokens=3)


def test_program_pin_on_backends_with_and_without_pinning():
    prefix = SHARED + "Q: "  # the program's constant prefix
    plain = _Cached()
    with pytest.warns(UserWarning, match="_Cached cannot pin a prefix"):
        assert _tea.pin(plain) == prefix
    assert plain.cached == [prefix] and _tea.unpin(plain) is False
    pinning = _Pinning()
    assert _tea.pin(pinning) == _tea.pin(pinning) == prefix  # once per backend
    assert pinning.pinned == [prefix] and pinning.cached == []
    assert _tea.unpin(pinning) is True and pinning.unpinned == [7]
    assert _tea.unpin(pinning) is False
