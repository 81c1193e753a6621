"""When a request speculates, and how far: `RequestGate` keeps a request's recent acceptance
(decayed counts of accepted drafts and of rejections: a per-token acceptance probability) and
pauses it (exponential back-off in output tokens) when drafts do not pay; `best_draft_length`
weighs the tokens a chain is expected to yield against what its verify pass costs."""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past in the acceptance counts, per verify pass
MIN_VERIFIES = 2  # verify passes before low acceptance pauses a request
FIRST_PAUSE = 16  # output tokens a request decodes without drafts after low acceptance
MAX_PAUSE = 256
MAX_MISS_SKIP = 8  # most decode steps skipped after consecutive misses (no draft found)


@dataclass(slots=True)
class RequestGate:
    resume_at: int = 0  # output length from which the request drafts again
    successes: float = 0.0  # decayed accepted draft tokens
    failures: float = 0.0  # decayed rejections (verify passes that rejected a draft)
    verifies: int = 0  # verify passes since the last pause
    pause: int = FIRST_PAUSE  # the next pause
    misses: int = 0  # consecutive attempts that found no draft
    pauses: int = 0
    probe: bool = True  # the next chain is a probe: full length, whatever the cost model says

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token is accepted (prior: 1/2)."""
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)

    def open(self, output_len: int) -> bool:
        return output_len >= self.resume_at

    def missed(self, output_len: int) -> None:
        self.misses += 1
        self.resume_at = output_len + min(2 ** (self.misses - 1), MAX_MISS_SKIP) - 1

    def verified(self, *, drafted: int, accepted: int, output_len: int,
                 min_rate: float) -> bool:
        """Records a verify pass; True when it paused the request (low acceptance)."""
        self.misses = 0
        self.probe = False
        self.successes = DECAY * self.successes + accepted
        self.failures = DECAY * self.failures + (1.0 if accepted < drafted else 0.0)
        self.verifies += 1
        if self.verifies >= MIN_VERIFIES and self.alpha < min_rate:
            self.pause_now(output_len)
            return True
        if self.alpha >= 2 * min_rate:
            self.pause = FIRST_PAUSE
        return False

    def pause_now(self, output_len: int) -> None:
        """No drafts for the next `pause` output tokens (doubling each time); then it starts
        afresh from the prior."""
        self.resume_at = output_len + self.pause
        self.pause = min(self.pause * 2, MAX_PAUSE)
        self.successes = self.failures = 0.0
        self.verifies = 0
        self.pauses += 1
        self.probe = True


def best_draft_length(alpha: float, *, fixed: float, per_draft: float, longest: int) -> int:
    """The draft length d in [0, longest] with the most expected tokens per unit of cost: a chain
    of d drafts yields 1 + alpha + ... + alpha^d tokens for `1 + fixed + per_draft * d` decode
    passes' worth of time (d = 0 is a plain decode: 1 for 1)."""
    best, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for d in range(1, longest + 1):
        term *= alpha
        expected += term
        rate = expected / (1.0 + fixed + per_draft * d)
        if rate > best_rate:
            best, best_rate = d, rate
    return best
