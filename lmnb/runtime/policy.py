"""Orders the waiting queue before admission."""

from __future__ import annotations

from collections.abc import Callable

from lmnb.runtime.core import Req

_POLICIES: dict[str, type[SchedulePolicy]] = {}


def register_policy(name: str) -> Callable[[type[SchedulePolicy]], type[SchedulePolicy]]:
    def register(cls: type[SchedulePolicy]) -> type[SchedulePolicy]:
        _POLICIES[name] = cls
        cls.name = name
        return cls

    return register


class SchedulePolicy:
    name = "base"

    def order(self, waiting: list[Req]) -> list[Req]:
        raise NotImplementedError


@register_policy("fcfs")
class FirstComeFirstServed(SchedulePolicy):
    def order(self, waiting: list[Req]) -> list[Req]:
        return list(waiting)


def make_policy(name: str) -> SchedulePolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown schedule_policy {name!r}; available: {sorted(_POLICIES)}")
    return _POLICIES[name]()
