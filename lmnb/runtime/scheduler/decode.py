"""Decode admission: every running request decodes one token; when KV runs out, the requests
with the fewest output tokens are retracted (their KV goes to the cache; they recompute later).
Also keeps `new_token_ratio`, the share of outstanding `max_new_tokens` reserved for running
requests when admitting new ones."""

from __future__ import annotations

from lmnb.runtime.core import Req
from lmnb.runtime.scheduler.cache_manager import CacheManager


class DecodeManager:
    def __init__(self, cache: CacheManager, *, init_new_token_ratio: float,
                 min_new_token_ratio: float, new_token_ratio_decay: float) -> None:
        self.cache = cache
        self.min_new_token_ratio = min_new_token_ratio
        self.decay = new_token_ratio_decay
        self.new_token_ratio = init_new_token_ratio

    def reserved(self, running: list[Req]) -> int:
        outstanding = sum(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
                          for req in running)
        return int(outstanding * self.new_token_ratio)

    def retract_until_decodable(self, running: list[Req]) -> list[Req]:
        """Removes requests from `running` (in place) until each remaining one can get a slot;
        returns them, KV already handed to the cache."""
        if self.cache.room() >= len(running):
            return []
        victims = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted = []
        while len(running) > 1 and self.cache.room() < len(running):
            victim = victims.pop(0)
            running.remove(victim)
            self.cache.cache_finished(victim)
            victim.retractions += 1
            retracted.append(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        return retracted

    def decayed(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_new_token_ratio)
