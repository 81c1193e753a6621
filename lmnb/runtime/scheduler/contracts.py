"""What the scheduler is configured with (`SchedulerConfig`) and the seams it calls: the output
sink, the step / verify / overlap runners, the speculator and the jump-forward planner (Protocols,
implemented by the engine's collaborators and by test fakes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lmnb.runtime.core import Batch, Req, StepOutput, VerifyOutput
from lmnb.runtime.output.events import TokenEvent
from lmnb.runtime.scheduler.overlap import PendingStep
from lmnb.runtime.scheduler.request_state import ReqState

if TYPE_CHECKING:
    from lmnb.runtime.fsm.jump import JumpPlan


@dataclass(slots=True)
class SchedulerConfig:
    chunked_prefill_size: int = 2048  # most prompt tokens prefilled in one pass
    init_new_token_ratio: float = 0.7  # share of max_new_tokens reserved for running requests
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per decode pass
    in_batch_prefix_min_tokens: int = 32  # defer a request sharing this many uncached tokens
    shared_prefix_min_tokens: int = 0  # decode groups sharing this many cached tokens (0: off)
    check_integrity_each_step: bool = False
    overlap_schedule: bool = False  # needs a runner with `launch` (OverlapRunner)
    overlap_extend: bool = True  # with overlap_schedule: prefill passes too (off: ablation)
    # requests that only the length limit ends admitted by their exact peak (kv_peak.py); off
    # (ablation, LMNB_DISABLE_EXACT_ADMISSION=1): by the reserve, as requests that may stop early
    exact_length_admission: bool = True
    weight_version: str = "default"  # reported in each request's meta_info (SGLang's)

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")

    def conservative(self, factor: float) -> SchedulerConfig:
        """The new-token ratios scaled by `factor` (SGLang's schedule_conservativeness): the
        reserve starts at init * factor and decays to min * factor over the same passes."""
        init = min(self.init_new_token_ratio * factor, 1.0)
        least = min(self.min_new_token_ratio * factor, init)
        passes = (self.init_new_token_ratio - self.min_new_token_ratio) / self.new_token_ratio_decay
        self.init_new_token_ratio, self.min_new_token_ratio = init, least
        self.new_token_ratio_decay = (init - least) / passes if passes > 0 else 0.0
        return self


class OutputSink(Protocol):
    def put(self, events: list[TokenEvent]) -> None:
        """Called once per step from the scheduler; must not block."""


class StepRunner(Protocol):
    def run(self, batch: Batch, rows: list[ReqState]) -> StepOutput:
        """Forward `batch`, sample for `rows` (the requests with `samples[i]`, in order); per
        request of the batch: next token or None, logprobs."""


class VerifyRunner(Protocol):
    def verify(self, batch: Batch, rows: list[ReqState]) -> VerifyOutput:
        """Forward a verify `batch` (`batch.drafts`) and decide, per request of `rows` (all of
        the batch, in order), the tokens it keeps."""


class Speculator(Protocol):
    """Proposes draft tokens and learns from verify passes (`speculative.Speculator`)."""

    def propose(self, states: Sequence[ReqState], room: int) -> list[list[int]] | None:
        """Per request its drafts (at most `room` tokens in all), or None: a plain decode."""

    def may_draft(self, states: Sequence[ReqState]) -> bool:
        """Whether a request might draft at its next step (the overlap pipeline then stops)."""

    def verified(self, req: Req, *, drafted: int, accepted: int) -> None:
        """After a verify pass, before the kept tokens are appended."""

    def finished(self, req: Req, *, keep: bool) -> None:
        """`req` ended; `keep`: its tokens may serve later requests' drafts."""

    def timed(self, batch: Batch, seconds: float) -> None:
        """A pass run synchronously took `seconds` (what verify passes cost next to decodes)."""

    def check(self) -> None:
        """Raises AssertionError unless the speculator's own KV (a draft model's) adds up."""

    def reset(self) -> None:
        """Forgets what finished requests taught it (`Runtime.flush_cache`)."""

    def close(self) -> None:
        """Frees what it holds (a draft model); after the scheduler stopped."""

    def report(self) -> dict[str, Any]:
        """Its part of `Runtime.stats()` (`stats()["speculative"]`)."""


class OverlapRunner(StepRunner, Protocol):
    def launch(self, batch: Batch, rows: list[ReqState]) -> PendingStep:
        """Enqueues `batch` and returns at once; a `follows_previous` batch takes the tokens
        the previous launch sampled as its input ids."""


class JumpPlanner(Protocol):
    def plan(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
             forced_text: str) -> JumpPlan | None:
        """How to append `forced_text` to the output (re-tokenized), or None: decode on."""
