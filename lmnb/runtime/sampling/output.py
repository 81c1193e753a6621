"""One sampling step's result: device tensors at once, host copies after one wait."""

from __future__ import annotations

from collections.abc import Callable

import torch

MASKED = -1  # next_token_ids value of a row whose every token is masked
NOT_FINITE = -2  # ... of a row whose logits hold NaN or +inf
_CPU = torch.device("cpu")


def unsampled_reason(token_id: int) -> str:
    """Why a row whose sampled id is MASKED / NOT_FINITE has no token."""
    if token_id == MASKED:
        return ("every token is masked (min_new_tokens EOS/stop ids, grammar mask or -inf "
                "logits); nothing can be sampled")
    return "logits contain nan or +inf"


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Starts a non-blocking copy into pinned memory (CUDA: one dispatch, the copy allocates its
    pinned output); on the CPU the tensor itself."""
    if tensor.device.type != "cuda":
        return tensor
    return tensor.to(_CPU, non_blocking=True)


class SampleOutput:
    """Sampled ids [bs] int64 on the device (`next_token_ids`, usable by further device work at
    once), optional logprobs of the rows that asked (`logprob_positions`, all rows by default),
    and their host copies, started when the output is created.

    Call `wait()` (or any of the list accessors) once per step: it waits for the copies and names
    the rows that could not be sampled (their ids are MASKED / NOT_FINITE); `synchronize()` raises
    RuntimeError for the first of them instead.
    """

    def __init__(self, next_token_ids: torch.Tensor, *, packed_logprobs: torch.Tensor | None,
                 top_width: int, top_logprobs_nums: list[int], label: Callable[[int], str],
                 logprob_positions: list[int] | None = None,
                 token_ids_logprobs: list[list[int] | None] | None = None) -> None:
        self.next_token_ids = next_token_ids
        # Of the rows that asked, in one float32 tensor: [n, 2 + 2 * k (+ m)], per row its
        # sampled id (or MASKED / NOT_FINITE), the id's logprob, the k best logprobs (best
        # first) and their ids (ids are exact in float32: < 2**24), then the logprobs of its
        # `asked_token_ids[row]` (m: the most ids a row asked for); None when no row asked.
        self.packed_logprobs = packed_logprobs
        self.top_width = top_width  # k: the most top logprobs a row asked for
        self.top_logprobs_nums = top_logprobs_nums
        self.asked_token_ids = token_ids_logprobs or [None] * len(top_logprobs_nums)
        self.logprob_positions = (list(range(len(top_logprobs_nums)))
                                  if logprob_positions is None else logprob_positions)
        self._label = label
        # When every row of a GPU batch asked, the packed copy brings the ids too: one copy.
        ids_packed = (packed_logprobs is not None and next_token_ids.device.type == "cuda"
                      and len(self.logprob_positions) == len(top_logprobs_nums))
        self.next_token_ids_cpu: torch.Tensor | None = (
            None if ids_packed else _to_host(next_token_ids))  # set by `synchronize` if None
        self._logprobs_cpu = None if packed_logprobs is None else _to_host(packed_logprobs)
        # The copies' targets (pinned on CUDA); the ids unpacked from the packed copy by
        # `synchronize` are a host-side conversion, not a copy target.
        self._copies = tuple(t for t in (self.next_token_ids_cpu, self._logprobs_cpu)
                             if t is not None)
        self._rows: list[list[float]] | None = None  # the host copy as lists, read once
        self._event: torch.cuda.Event | None = None
        if next_token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._failed: dict[int, str] | None = None  # set by `wait`

    def wait(self) -> dict[int, str]:
        """Waits for the host copies -> {row: why nothing could be sampled there}, empty when
        every row sampled a token."""
        if self._failed is not None:
            return self._failed
        if self._event is not None:
            self._event.synchronize()
        if self.next_token_ids_cpu is None:
            assert self._logprobs_cpu is not None
            self.next_token_ids_cpu = self._logprobs_cpu[:, 0].to(torch.int64)
        ids = self.next_token_ids_cpu
        self._failed = {}
        for row in (ids < 0).nonzero().flatten().tolist():
            self._failed[row] = f"{self._label(row)}: {unsampled_reason(int(ids[row]))}"
        return self._failed

    def synchronize(self) -> None:
        """`wait`, raising RuntimeError for the first row that could not be sampled."""
        failed = self.wait()
        if failed:
            raise RuntimeError(failed[min(failed)])

    def host_copies(self) -> list[torch.Tensor]:
        """The host tensors the device's results are copied into (pinned on CUDA): one when
        every row of a GPU batch asked for logprobs (the packed copy brings the ids)."""
        return list(self._copies)

    @property
    def next_token_logprobs(self) -> torch.Tensor | None:
        """[n] float32 of the rows that asked (device); None when none did."""
        return None if self.packed_logprobs is None else self.packed_logprobs[:, 1]

    @property
    def top_logprob_values(self) -> torch.Tensor | None:
        """[n, k] float32, best first (device); None without top logprobs."""
        if self.packed_logprobs is None or not self.top_width:
            return None
        return self.packed_logprobs[:, 2:2 + self.top_width]

    @property
    def top_logprob_ids(self) -> torch.Tensor | None:
        """[n, k] int64 ids of `top_logprob_values` (device); None without top logprobs."""
        if self.packed_logprobs is None or not self.top_width:
            return None
        return self.packed_logprobs[:, 2 + self.top_width:2 + 2 * self.top_width].long()

    def _host_rows(self) -> list[list[float]]:
        """The packed host copy as lists (after `synchronize`), converted once per step."""
        if self._rows is None:
            assert self._logprobs_cpu is not None
            self._rows = self._logprobs_cpu.tolist()
        return self._rows

    def token_ids(self) -> list[int]:
        """Per row its id (MASKED / NOT_FINITE where `wait` names the row)."""
        self.wait()
        return self.next_token_ids_cpu.tolist()

    def logprobs(self) -> list[float] | None:
        """Per row the raw log-softmax of its sampled token (0.0 for a row that did not ask), or
        None when no row asked."""
        self.wait()
        if self._logprobs_cpu is None:
            return None
        values = [row[1] for row in self._host_rows()]
        if len(values) == len(self.top_logprobs_nums):
            return values
        out = [0.0] * len(self.top_logprobs_nums)
        for row, value in zip(self.logprob_positions, values, strict=True):
            out[row] = value
        return out

    def top_logprobs(self) -> list[list[tuple[float, int]]] | None:
        """Per row its `top_logprobs_num` best (logprob, id), best first; None when no row asked."""
        self.wait()
        if not self.top_width or self._logprobs_cpu is None:
            return None
        width = self.top_width
        nums = self.top_logprobs_nums
        out: list[list[tuple[float, int]]] = [[] for _ in nums]
        for row, packed in zip(self.logprob_positions, self._host_rows(), strict=True):
            if n := nums[row]:
                out[row] = list(zip(packed[2:2 + n], map(int, packed[2 + width:2 + width + n]),
                                    strict=True))
        return out

    def token_ids_logprobs(self) -> list[list[tuple[float, int]] | None] | None:
        """Per row the (logprob, id) of each id it asked for (`asked_token_ids`), in its
        order (None for a row that asked for none); None when no row asked."""
        self.wait()
        if self._logprobs_cpu is None or not any(self.asked_token_ids):
            return None
        first = 2 + 2 * self.top_width
        out: list[list[tuple[float, int]] | None] = [None] * len(self.top_logprobs_nums)
        for row, packed in zip(self.logprob_positions, self._host_rows(), strict=True):
            if ids := self.asked_token_ids[row]:
                out[row] = list(zip(packed[first:first + len(ids)], ids, strict=True))
        return out
