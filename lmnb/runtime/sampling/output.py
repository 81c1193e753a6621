"""One sampling step's result: device tensors at once, host copies after one wait."""

from __future__ import annotations

from collections.abc import Callable

import torch

MASKED = -1  # next_token_ids value of a row whose every token is masked
NOT_FINITE = -2  # ... of a row whose logits hold NaN or +inf


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Starts a non-blocking copy into pinned memory (CUDA); on the CPU the tensor itself."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class SampleOutput:
    """Sampled ids [bs] int64 on the device (`next_token_ids`, usable by further device work at
    once), optional logprobs of the rows that asked (`logprob_positions`, all rows by default),
    and their host copies, started when the output is created.

    Call `synchronize()` (or any of the list accessors) once per step: it waits for the copies and
    raises RuntimeError for a row that could not be sampled.
    """

    def __init__(self, next_token_ids: torch.Tensor, *, logprobs: torch.Tensor | None,
                 top_values: torch.Tensor | None, top_ids: torch.Tensor | None,
                 top_logprobs_nums: list[int], label: Callable[[int], str],
                 logprob_positions: list[int] | None = None) -> None:
        self.next_token_ids = next_token_ids
        self.next_token_logprobs = logprobs  # [n] float32 (rows that asked), None when none did
        self.top_logprob_values = top_values  # [n, max wanted] float32, best first
        self.top_logprob_ids = top_ids
        self.top_logprobs_nums = top_logprobs_nums
        self.logprob_positions = (list(range(len(top_logprobs_nums)))
                                  if logprob_positions is None else logprob_positions)
        self._label = label
        self.next_token_ids_cpu = _to_host(next_token_ids)
        # The logprobs, top values and top ids (exact in float32: ids < 2**24) in one copy:
        # [n, 1 + 2 * max wanted]
        self._logprobs_cpu = None if logprobs is None else _to_host(
            logprobs[:, None] if top_values is None
            else torch.cat([logprobs[:, None], top_values, top_ids.to(torch.float32)], dim=1))
        self._event: torch.cuda.Event | None = None
        if next_token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._checked = False

    def synchronize(self) -> None:
        """Waits for the host copies; raises RuntimeError naming the first row that failed."""
        if self._checked:
            return
        if self._event is not None:
            self._event.synchronize()
        ids = self.next_token_ids_cpu
        bad = (ids < 0).nonzero()
        if len(bad):
            row = int(bad[0, 0])
            if int(ids[row]) == MASKED:
                raise RuntimeError(
                    f"{self._label(row)}: every token is masked (min_new_tokens EOS/stop ids, "
                    "grammar mask or -inf logits); nothing can be sampled")
            raise RuntimeError(f"{self._label(row)}: logits contain nan or +inf")
        self._checked = True

    def token_ids(self) -> list[int]:
        self.synchronize()
        return self.next_token_ids_cpu.tolist()

    def logprobs(self) -> list[float] | None:
        """Per row the raw log-softmax of its sampled token (0.0 for a row that did not ask), or
        None when no row asked."""
        self.synchronize()
        if self._logprobs_cpu is None:
            return None
        values = self._logprobs_cpu[:, 0].tolist()
        if len(values) == len(self.top_logprobs_nums):
            return values
        out = [0.0] * len(self.top_logprobs_nums)
        for row, value in zip(self.logprob_positions, values, strict=True):
            out[row] = value
        return out

    def top_logprobs(self) -> list[list[tuple[float, int]]] | None:
        """Per row its `top_logprobs_num` best (logprob, id), best first; None when no row asked."""
        self.synchronize()
        if self.top_logprob_values is None or self._logprobs_cpu is None:
            return None
        width = self.top_logprob_values.shape[1]
        nums = self.top_logprobs_nums
        out: list[list[tuple[float, int]]] = [[] for _ in nums]
        for row, packed in zip(self.logprob_positions, self._logprobs_cpu.tolist(), strict=True):
            if n := nums[row]:
                out[row] = list(zip(packed[1:1 + n], map(int, packed[1 + width:1 + width + n]),
                                    strict=True))
        return out
