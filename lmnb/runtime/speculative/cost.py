"""`PassCost`: what a verify pass costs next to a decode pass on this device, measured online
from the scheduler's synchronous passes and fitted as `verify / decode = 1 + fixed + per_draft * d`
for d draft positions. On a GPU the fixed part dominates when decode replays a CUDA graph and
verify runs eagerly; on a CPU the per-draft part does (the forward turns from reading weights
into computing). Medians and a Theil-Sen fit over the recent passes keep a busy machine's
outliers from deciding."""

from __future__ import annotations

import statistics
from collections import deque

PRIOR_FIXED = 0.1
PRIOR_PER_DRAFT = 0.1
WINDOW = 32  # recent passes of each kind
MIN_SAMPLES = 3  # verify passes before the fit replaces the priors


class PassCost:
    def __init__(self) -> None:
        self._decodes: deque[float] = deque(maxlen=WINDOW)
        self._verifies: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (drafts, seconds)
        self._model: tuple[float, float] | None = None

    def decoded(self, seconds: float) -> None:
        self._decodes.append(seconds)
        self._model = None

    def verified(self, seconds: float, drafts: int) -> None:
        """A verify pass of `drafts` draft positions (beyond one position per request)."""
        if drafts > 0:
            self._verifies.append((drafts, seconds))
            self._model = None

    @property
    def decode_seconds(self) -> float | None:
        return statistics.median(self._decodes) if self._decodes else None

    def model(self) -> tuple[float, float]:
        """(fixed, per_draft) extra cost of a verify pass, in decode passes: the priors until
        measured; with one draft length seen, the prior slope and the measured rest."""
        if self._model is None:
            self._model = self._fit()
        return self._model

    def _fit(self) -> tuple[float, float]:
        decode = self.decode_seconds
        if decode is None or len(self._verifies) < MIN_SAMPLES:
            return PRIOR_FIXED, PRIOR_PER_DRAFT
        points = [(d, seconds / decode - 1.0) for d, seconds in self._verifies]
        slopes = [(yj - yi) / (dj - di) for i, (di, yi) in enumerate(points)
                  for dj, yj in points[i + 1:] if dj != di]
        slope = max(statistics.median(slopes), 0.0) if slopes else PRIOR_PER_DRAFT
        fixed = statistics.median(y - slope * d for d, y in points)
        return max(fixed, 0.0), slope
