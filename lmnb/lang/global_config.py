"""`lmnb.global_config`: SGLang's frontend settings object, with the fields programs commonly read.

`default_backend` is the program default (`set_default_backend`); `enable_precache_with_tracing`
turns `run_batch`'s shared-prefix caching on or off; `batch_switch_interval` is lmnb's (the GIL
switch interval while a `run_batch` starts its programs, `lmnb.lang.gil_share`), and so is
`batch_wave` and `batch_lead_wave` (the programs start in a lead wave and then together, or
in growing waves: `lmnb.lang.batch_waves`). The other
fields are kept for programs that set or read them and change nothing here (lmnb's detokenizer
always skips special tokens)."""

from __future__ import annotations

from typing import Any

from lmnb.lang.backends.base import Backend
from lmnb.lang.default_backend import BackendSource, default_backend, set_default_backend
from lmnb.runtime.prompts import FIRST_CHUNK


class GlobalConfig:
    def __init__(self) -> None:
        self.verbosity = 0
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True
        # lmnb's: the GIL switch interval (s) while a run_batch starts its programs (`gil_share`;
        # None: Python's own, 5 ms unless set).
        self.batch_switch_interval: float | None = 5e-5
        # lmnb's: how a run_batch starts its programs: None, a lead wave of `batch_lead_wave`
        # programs spread over the batch (None: none), then the rest in one turn of the program
        # loop, each wave's first gens sent to the scheduler in one hand-over; n, in waves of
        # n, 2n, 4n, ... with their gens sent in chunks of as many.
        self.batch_wave: int | None = None
        self.batch_lead_wave: int | None = FIRST_CHUNK

    @property
    def default_backend(self) -> Backend | BackendSource | None:
        return default_backend()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        set_default_backend(backend)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"GlobalConfig({fields}, default_backend={self.default_backend!r})"


global_config = GlobalConfig()
