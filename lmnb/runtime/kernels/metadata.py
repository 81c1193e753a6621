"""Per-step attention metadata built on the device with vectorised torch ops (no host sync).

Sizes (`num_tokens`, `num_kv_tokens`, `max_kv_len`) come from the host lists the scheduler already
holds, so no function here reads a device value back. A Triton kernel can replace any of them.

    qo_indptr   [bs + 1]  request i's query tokens are rows qo_indptr[i] : qo_indptr[i + 1]
    kv_indptr   [bs + 1]  request i's KV slots are kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices  [num_kv_tokens]  KV slots in token order: req_to_token[req, 0 : seq_len]
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch


def host_int64(values: Sequence[int], *, pin: bool = False) -> torch.Tensor:
    """[len(values)] int64 CPU tensor of Python ints, converted at C speed (an `array` viewed by
    the tensor: several times cheaper than `torch.tensor` on a list); in pinned memory if `pin`."""
    try:
        host = torch.frombuffer(array("q", values), dtype=torch.int64) if len(values) else \
            torch.empty(0, dtype=torch.int64)
    except TypeError:  # not plain ints (e.g. numpy integers): the general conversion
        host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if pin else host


def device_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device` without waiting for the device's queued work: on CUDA
    through pinned memory and a non-blocking copy (`torch.tensor(..., device="cuda")` copies
    from pageable memory, which waits for the stream, e.g. for a pass in flight)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on `device` that waits for nothing queued there: on CUDA staged in
    pinned memory and copied non-blocking (a plain `.to(device)` from the host waits for the
    stream: for the whole pass just enqueued)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def build_indptr(lens: torch.Tensor) -> torch.Tensor:
    """[bs] lengths -> [bs + 1] exclusive prefix sums starting at 0."""
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, dim=0, out=indptr[1:])
    return indptr


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, kv_indptr: torch.Tensor,
                     num_kv_tokens: int) -> torch.Tensor:
    """[num_kv_tokens] KV slots of every request's first `seq_len` positions, request by request.

    `num_kv_tokens` must equal `seq_lens.sum()` (the caller knows it on the host).
    """
    # Flat index of req_to_token[req, j] for the j-th KV token of a request starting at
    # kv_indptr[i]: req * width + (t - kv_indptr[i]) for the t-th KV token overall.
    offsets = req_pool_indices * req_to_token.shape[1] - kv_indptr[:-1]
    index = torch.repeat_interleave(offsets, seq_lens, output_size=num_kv_tokens)
    index += torch.arange(num_kv_tokens, device=seq_lens.device)
    return torch.take(req_to_token, index)


def build_positions(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, qo_indptr: torch.Tensor,
                    num_tokens: int) -> torch.Tensor:
    """[num_tokens] position of each new token: prefix_len + its offset within its request."""
    shift = torch.repeat_interleave(prefix_lens - qo_indptr[:-1], extend_lens,
                                    output_size=num_tokens)
    return torch.arange(num_tokens, device=prefix_lens.device) + shift


def padded_kv_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
                    max_kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged KV slots -> ([bs, max_kv_len] slots, [bs, max_kv_len] valid) for padded decode.

    Requires `max_kv_len >= max(seq_lens)`. Invalid entries read slot 0, the pool's padding slot
    (always finite: a masked weight times a NaN would still be NaN).
    """
    cols = torch.arange(max_kv_len, device=seq_lens.device)
    valid = cols[None, :] < seq_lens[:, None]
    index = (kv_indptr[:-1, None] + cols[None, :]).clamp_(max=max(kv_indices.numel() - 1, 0))
    return torch.take(kv_indices, index).masked_fill_(~valid, 0), valid


class DecodeBuffers:
    """Static seq_lens / kv_indptr / kv_indices for captured decode graphs of up to `max_bs` rows.

    `fill(fb, bs)` copies a decode batch of n <= bs requests into the first rows and turns rows
    n..bs into dummies of one KV token each, slot 0 (the pool's padding slot), so a kernel captured
    for bs rows reads valid metadata. The buffers' addresses never change.
    """

    def __init__(self, max_bs: int, kv_capacity: int, device: torch.device, *,
                 index_dtype: torch.dtype = torch.int64) -> None:
        """`index_dtype`: kv_indptr's and kv_indices' (the batch's int64 are cast on `fill`)."""
        self.max_bs = max_bs
        self.kv_capacity = kv_capacity
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.kv_indptr = torch.arange(max_bs + 1, dtype=index_dtype, device=device)
        self.kv_indices = torch.zeros(kv_capacity + max_bs, dtype=index_dtype, device=device)
        self._steps = torch.arange(1, max_bs + 1, dtype=index_dtype, device=device)

    def fits(self, batch_size: int, num_kv_tokens: int) -> bool:
        return batch_size <= self.max_bs and num_kv_tokens <= self.kv_capacity

    def fill(self, *, seq_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             num_kv_tokens: int, bs: int) -> None:
        n = seq_lens.numel()
        if not (n <= bs <= self.max_bs and self.fits(n, num_kv_tokens)):
            raise ValueError(f"decode batch of {n} requests / {num_kv_tokens} KV tokens does not "
                             f"fit graph size {bs} (max {self.max_bs}, {self.kv_capacity} tokens)")
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.kv_indptr[:n + 1].copy_(kv_indptr)
        torch.add(self._steps[:bs - n], num_kv_tokens, out=self.kv_indptr[n + 1:bs + 1])
        self.kv_indices[:num_kv_tokens].copy_(kv_indices)
        self.kv_indices[num_kv_tokens:num_kv_tokens + bs - n].zero_()
