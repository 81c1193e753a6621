"""`PassProfiler`: a torch profiler over the scheduler's forward passes, SGLang's
`/start_profile` and `/stop_profile` (`Runtime.start_profile`, `Runtime.stop_profile`).

It is started and stopped on the scheduler thread, between steps; the scheduler tells it of every
pass it completes (`passed`), so that `num_steps` stops it by itself after that many passes. A
stop writes one Chrome trace, `<output_dir>/<profile id>-TP-0.trace.json.gz` as SGLang names it
(rank 0's: the scheduler's process; tensor-parallel workers are not traced)."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmnb.params import InvalidRequestError

logger = logging.getLogger(__name__)

_ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU,
               "GPU": torch.profiler.ProfilerActivity.CUDA}


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """SGLang's `ProfileReqInput` fields lmnb implements. `output_dir` None: a new temporary
    directory; `num_steps` None: until `stop`; `activities` None: CPU, and GPU on a CUDA
    runtime; `with_stack` None: True and `record_shapes` None: False, as SGLang's defaults."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None

    def __post_init__(self) -> None:
        if self.num_steps is not None and self.num_steps < 1:
            raise InvalidRequestError(f"num_steps must be at least 1, got {self.num_steps}",
                                      param="num_steps")
        unknown = [a for a in self.activities or () if a not in _ACTIVITIES]
        if unknown:
            raise InvalidRequestError(f"activities {unknown} are not traced by lmnb; "
                                      f"choose from {sorted(_ACTIVITIES)}", param="activities")


class PassProfiler:
    """At most one profile at a time; every method runs on the scheduler thread."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._trace: Path | None = None  # where the running profile's trace goes
        self._passes_left: int | None = None
        self.last_trace: Path | None = None  # the trace the latest stop wrote

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, options: ProfileOptions, *, device: torch.device) -> Path:
        """Starts tracing the passes of a runtime on `device`; returns the directory the trace
        will be written to."""
        if self._profile is not None:
            raise InvalidRequestError("Profiling is already in progress. Call /stop_profile "
                                      "first.")
        names = options.activities or (("CPU", "GPU") if device.type == "cuda" else ("CPU",))
        if "GPU" in names and device.type != "cuda":
            raise InvalidRequestError(f"activity GPU needs a CUDA runtime; this one runs on "
                                      f"{device.type}", param="activities")
        directory = Path(options.output_dir if options.output_dir is not None
                         else tempfile.mkdtemp(prefix="lmnb-profile-"))
        directory.mkdir(parents=True, exist_ok=True)
        profile = torch.profiler.profile(
            activities=[_ACTIVITIES[name] for name in names],
            with_stack=True if options.with_stack is None else options.with_stack,
            record_shapes=bool(options.record_shapes))
        profile.start()
        self._profile, self._passes_left = profile, options.num_steps
        self._trace = directory / f"{time.time()}-TP-0.trace.json.gz"
        logger.info("profiling starts; the trace goes to %s", self._trace)
        return directory

    def passed(self) -> None:
        """One forward pass completed: with `num_steps`, the last one stops the profile."""
        if self._passes_left is None:
            return
        self._passes_left -= 1
        if self._passes_left == 0:
            try:
                self.stop()
            except OSError:  # an unwritable trace must not fail the pass
                logger.exception("profiling stopped after num_steps; the trace was not written")

    def stop(self) -> Path:
        """Stops tracing and writes the trace; returns its path."""
        profile, trace = self._profile, self._trace
        if profile is None or trace is None:
            raise InvalidRequestError("Profiling is not in progress. Call /start_profile first.")
        self._profile, self._trace, self._passes_left = None, None, None
        profile.stop()
        profile.export_chrome_trace(str(trace))
        self.last_trace = trace
        logger.info("profiling done; trace saved to %s", trace)
        return trace
