"""`start_waves`: the order in which a `run_batch` starts its programs, as waves of indices.

Each wave's first gens reach the scheduler before the next wave's bodies run. By default
(`global_config.batch_wave` None) a large batch starts with a lead wave of
`global_config.batch_lead_wave` programs spread evenly over it (every size/n-th): their gens are
handed over at once and the engine prefills them while the rest start together, handed over in
one message that the next pass is planned with, as for `generate` of a list of ids. Spread, the
lead wave meets as many of the batch's distinct prompts as it can: batches are often grouped (a
few-shot prefix per task, the questions of each task together), and the scheduler admits one
request per uncached shared prefix to a pass, holding back the others until it is cached, so a
lead wave of one group would fill the first pass with one request. `batch_wave` n: contiguous
waves of n, 2n, 4n, ... programs.
"""

from __future__ import annotations

from lmnb.runtime.prompts import chunk_bounds


def lead_indices(size: int, lead: int) -> list[int]:
    """`lead` indices of a batch of `size` (more than `lead`), spread evenly, the first 0."""
    return [i * size // lead for i in range(lead)]


def start_waves(size: int, *, lead: int | None, wave: int | None) -> list[list[int]]:
    """The indices of a batch of `size` programs in the waves they start in. A lead wave is
    used only when the rest is larger than it (a small batch starts together)."""
    if wave is not None:
        return [list(range(start, end)) for start, end in chunk_bounds(size, wave)]
    if lead is None or lead <= 0 or size <= 2 * lead:
        return [list(range(size))]
    first = lead_indices(size, lead)
    chosen = set(first)
    return [first, [i for i in range(size) if i not in chosen]]
