"""bench/instrument.py: wrapped class and module functions record every call, raising ones too,
and are put back as they were (a staticmethod stays one)."""

from __future__ import annotations

import types

import pytest

from bench.instrument import Call, Patches


class Owner:
    def method(self, x: int) -> int:
        return x + 1

    @staticmethod
    def static(x: int) -> int:
        if x < 0:
            raise ValueError(x)
        return 2 * x


def test_wrapped_calls_are_recorded_and_put_back():
    originals = dict(vars(Owner))
    module = types.ModuleType("pkg.mod")
    module.function = lambda: "f"
    calls: list[Call] = []
    before: list[str] = []
    with Patches() as patches:
        patches.wrap(Owner, "method", calls.append, before=lambda: before.append("m"))
        patches.wrap(Owner, "static", calls.append)
        patches.wrap(module, "function", calls.append)
        patches.wrap(Owner, "method", calls.append)  # twice: the second wraps the first
        owner = Owner()
        assert owner.method(1) == 2 and Owner.static(3) == 6 and module.function() == "f"
        with pytest.raises(ValueError):
            owner.static(-1)
    assert [c.label for c in calls] == ["Owner.method", "Owner.method", "Owner.static",
                                        "mod.function", "Owner.static"]
    assert calls[0].args == (owner, 1) and calls[0].result == 2 and before == ["m"]
    assert calls[-1].result is None and calls[-1].args == (-1,)
    assert all(c.end >= c.start and c.seconds >= 0 for c in calls)
    assert dict(vars(Owner)) == originals and isinstance(vars(Owner)["static"], staticmethod)
    assert module.function() == "f" and len(calls) == 5  # no longer recorded
