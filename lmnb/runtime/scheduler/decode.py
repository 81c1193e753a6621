"""Decode admission: every running request decodes one token; when KV runs out, the requests
with the fewest output tokens are retracted (their KV goes to the cache; they recompute later).
Also what running requests will need when new ones are admitted: for requests that may stop
early, `new_token_ratio`, the share of outstanding `max_new_tokens` reserved; for requests that
only the length limit ends, their exact future (`KVPeak`)."""

from __future__ import annotations

from lmnb.runtime.core import Req
from lmnb.runtime.output.stop import ends_by_length_only
from lmnb.runtime.scheduler.cache_manager import CacheManager
from lmnb.runtime.scheduler.kv_peak import KVPeak


def tokens_left(req: Req) -> int:
    """Slots `req` may still allocate: one a decode pass until `max_new_tokens`."""
    return max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)


class DecodeManager:
    def __init__(self, cache: CacheManager, *, init_new_token_ratio: float,
                 min_new_token_ratio: float, new_token_ratio_decay: float,
                 exact_length_admission: bool = True) -> None:
        self.cache = cache
        self.exact_length_admission = exact_length_admission
        self.min_new_token_ratio = min_new_token_ratio
        self.decay = new_token_ratio_decay
        self.new_token_ratio = init_new_token_ratio

    def reserved(self, running: list[Req]) -> int:
        """KV kept back for the running requests that may stop early."""
        outstanding = sum(tokens_left(req) for req in running if not self.length_known(req))
        return int(outstanding * self.new_token_ratio)

    def known_peak(self, running: list[Req]) -> KVPeak:
        """The running requests that only the length limit ends: what they hold and will need."""
        return KVPeak([(req.kv_len, tokens_left(req)) for req in running
                       if self.length_known(req)])

    def length_known(self, req: Req) -> bool:
        """Admitted by its exact peak (`kv_peak.py`) rather than a reserve."""
        return self.exact_length_admission and ends_by_length_only(req.sampling_params)

    def retract_until_decodable(self, running: list[Req], chunked: Req | None = None
                                ) -> list[Req]:
        """Removes requests from `running` (in place) until each remaining one can get a slot;
        returns them, KV already handed to the cache. The last running request is kept: then
        `chunked`, a long prompt whose locked chunks took the room its admission left (the
        reserve is an estimate), goes back instead (returned last; its chunks cached)."""
        if self.cache.room() >= len(running):
            return []
        victims = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted: list[Req] = []
        while len(running) > 1 and self.cache.room() < len(running):
            victim = victims.pop(0)
            running.remove(victim)
            self._retract(victim, retracted)
        if chunked is not None and self.cache.room() < len(running):
            self._retract(chunked, retracted)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        return retracted

    def _retract(self, victim: Req, retracted: list[Req]) -> None:
        self.cache.cache_finished(victim)
        victim.retractions += 1
        retracted.append(victim)

    def decayed(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - self.decay, self.min_new_token_ratio)
