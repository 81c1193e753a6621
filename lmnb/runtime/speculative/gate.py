"""When a request speculates: `RequestGate` pauses a request whose recent drafts are rarely
accepted (exponential back-off in output tokens) and, more briefly, one for which no draft was
found (so that the overlap schedule runs between attempts)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_VERIFIES = 2  # verify passes before the acceptance rate is judged
FIRST_PAUSE = 16  # output tokens a request decodes without drafts after low acceptance
MAX_PAUSE = 256
MAX_MISS_SKIP = 8  # most decode steps skipped after consecutive misses


@dataclass(slots=True)
class RequestGate:
    resume_at: int = 0  # output length from which the request drafts again
    rate: float = 1.0  # recent share of draft tokens accepted (moving average)
    verifies: int = 0  # verify passes since the last pause
    pause: int = FIRST_PAUSE  # the next low-acceptance pause
    misses: int = 0  # consecutive attempts that found no draft
    pauses: int = 0

    def open(self, output_len: int) -> bool:
        return output_len >= self.resume_at

    def missed(self, output_len: int) -> None:
        self.misses += 1
        self.resume_at = output_len + min(2 ** (self.misses - 1), MAX_MISS_SKIP) - 1

    def verified(self, *, drafted: int, accepted: int, output_len: int,
                 min_rate: float) -> bool:
        """Records a verify pass; True when it paused the request (low acceptance)."""
        self.misses = 0
        rate = accepted / drafted
        self.rate = rate if self.verifies == 0 else 0.5 * self.rate + 0.5 * rate
        self.verifies += 1
        if self.verifies >= MIN_VERIFIES and self.rate < min_rate:
            self.resume_at = output_len + self.pause
            self.pause = min(self.pause * 2, MAX_PAUSE)
            self.verifies = 0
            self.pauses += 1
            return True
        if self.rate >= 2 * min_rate:
            self.pause = FIRST_PAUSE
        return False
