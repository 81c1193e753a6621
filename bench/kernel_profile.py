"""Where device time goes in a torch-profiler capture: kernels by category, GPU busy time (the
union of kernel intervals) against the wall time of what was profiled.

Categories come from kernel names (cuBLAS/cuBLASLt/CUTLASS, FlashInfer, our Triton kernels, torch's
ATen kernels); on a CPU capture the ATen op names stand in for kernels. Name-based: a cast of the
logits is a copy kernel like any other, so it lands in `copy_memset`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (category, pattern on the lowercased name); the first match wins, so attention comes before
# GEMM (FlashAttention-style kernels are CUTLASS too) and copies before plain elementwise kernels.
CATEGORY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("attention_decode", r"batchdecode|_decode_partial|_decode_merge|decode_att|splitkv"
                         r"|mergestates|merge_state|paged_attention"),
    ("attention_prefill", r"batchprefill|singleprefill|_extend_kernel|prefill|fmha|flash_fwd"
                          r"|attention|scaled_dot_product|sdpa"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|splitkreduce|cublas|matmul|aten::(mm|addmm|bmm|"
             r"linear)$"),
    ("norm_rope_act", r"rms_?norm|layer_?norm|rotary|rope|silu|gelu|act_and_mul|swiglu"),
    ("sampling_logits", r"softmax|argmax|topk|top_k|sort|multinomial|exponential|distribution"
                        r"|philox|gumbel|cumsum|aten::(max|div_?)$"),
    ("copy_memset", r"memcpy|memset|copy|catarray|aten::cat$|index_put|scatter|gather|fill"
                    r"|aten::(to|_to_copy|zero_|index|index_select|embedding)$"),
    ("elementwise", r"elementwise|aten::(add|mul|sub|div|neg|rsqrt|pow|mean|sum)_?$"),
)
CATEGORIES = tuple(c for c, _ in CATEGORY_PATTERNS) + ("other",)
_COMPILED = tuple((c, re.compile(p)) for c, p in CATEGORY_PATTERNS)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in _COMPILED:
        if pattern.search(lowered):
            return category
    return "other"


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def busy_us(events: Iterable[KernelEvent]) -> float:
    """Length of the union of the events' intervals (overlapping streams count once)."""
    total, end = 0.0, float("-inf")
    for event in sorted(events, key=lambda e: e.start_us):
        if event.end_us <= end:
            continue
        total += event.end_us - max(event.start_us, end)
        end = event.end_us
    return total


def device_events(prof: Any) -> list[KernelEvent]:
    """The device-side events (kernels, memcpy, memset) of a finished `torch.profiler.profile`;
    without any (a CPU capture), the leaf CPU ops instead."""
    events = list(prof.events())
    device = [e for e in events if e.device_type.name != "CPU"]
    if not device:
        device = [e for e in events if not e.cpu_children]
    return [KernelEvent(e.name, float(e.time_range.start), float(e.time_range.end))
            for e in device]


def idle_gaps(events: Sequence[KernelEvent], top: int = 12) -> dict[str, Any]:
    """Stretches with no kernel running: the `top` longest (where they start, ms after the first
    kernel, and the kernels on either side), their total by length bucket, and the kernel pairs
    (the one before -> the one after) whose gaps add up to the most idle time."""
    ordered = sorted(events, key=lambda e: e.start_us)
    gaps: list[dict[str, Any]] = []
    end, before = float("-inf"), None
    origin = ordered[0].start_us if ordered else 0.0
    for event in ordered:
        if before is not None and event.start_us > end:
            gaps.append({"at_ms": (end - origin) / 1e3, "ms": (event.start_us - end) / 1e3,
                         "after": before.name[:60], "before": event.name[:60]})
        if event.end_us > end:
            end, before = event.end_us, event
    buckets = {"<0.01 ms": 0.0, "0.01-0.1 ms": 0.0, "0.1-1 ms": 0.0, ">=1 ms": 0.0}
    counts = dict.fromkeys(buckets, 0)
    pairs: dict[str, float] = {}
    for gap in gaps:
        ms = gap["ms"]
        bucket = ("<0.01 ms" if ms < 0.01 else "0.01-0.1 ms" if ms < 0.1
                  else "0.1-1 ms" if ms < 1 else ">=1 ms")
        buckets[bucket] += ms
        counts[bucket] += 1
        pair = f"{gap['after'][:40]} -> {gap['before'][:40]}"
        pairs[pair] = pairs.get(pair, 0.0) + ms
    return {"longest": sorted(gaps, key=lambda g: -g["ms"])[:top],
            "ms_by_length": buckets, "count_by_length": counts,
            "top_pairs": sorted(pairs.items(), key=lambda kv: -kv[1])[:top]}


def summarize(events: Sequence[KernelEvent], *, wall_seconds: float, passes: int,
              top: int = 20) -> dict[str, Any]:
    """Per category: seconds, kernel count, ms per pass and share of kernel time; GPU busy time
    against the wall time; the `top` kernels by time."""
    by_category = {c: {"seconds": 0.0, "count": 0} for c in CATEGORIES}
    by_name: dict[str, dict[str, Any]] = {}
    for event in events:
        category = kernel_category(event.name)
        by_category[category]["seconds"] += event.duration_us / 1e6
        by_category[category]["count"] += 1
        entry = by_name.setdefault(event.name, {"name": event.name, "category": category,
                                                "seconds": 0.0, "count": 0})
        entry["seconds"] += event.duration_us / 1e6
        entry["count"] += 1
    kernel_seconds = sum(c["seconds"] for c in by_category.values())
    per_pass = max(passes, 1)
    for entry in by_category.values():
        entry["ms_per_pass"] = 1e3 * entry["seconds"] / per_pass
        entry["share"] = entry["seconds"] / kernel_seconds if kernel_seconds else 0.0
    busy = busy_us(events) / 1e6
    first_us = min(e.start_us for e in events) if events else 0.0
    span = (max(e.end_us for e in events) - first_us) / 1e6 if events else 0.0
    return {
        "passes": passes,
        "wall_seconds": wall_seconds,
        "kernel_seconds": kernel_seconds,
        "busy_seconds": busy,
        "span_seconds": span,
        # the first kernel's start, from the profiler's (just before the profiled call's)
        "first_kernel_seconds": first_us / 1e6,
        "busy_fraction_of_wall": busy / wall_seconds if wall_seconds else None,
        "wall_ms_per_pass": 1e3 * wall_seconds / per_pass,
        "busy_ms_per_pass": 1e3 * busy / per_pass,
        "idle_ms_per_pass": 1e3 * max(wall_seconds - busy, 0.0) / per_pass,
        "kernels_per_pass": len(events) / per_pass,
        "categories": by_category,
        "top_kernels": sorted(by_name.values(), key=lambda e: -e["seconds"])[:top],
        "idle_gaps": idle_gaps(events),
    }


def category_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """Rows for `format_table(CATEGORY_HEADERS, ...)`: the categories with any time, then the
    total."""
    rows = [[name, c["count"], 1e3 * c["seconds"], c["ms_per_pass"], f"{100 * c['share']:.1f}%"]
            for name, c in summary["categories"].items() if c["count"]]
    rows.append(["total", sum(c["count"] for c in summary["categories"].values()),
                 1e3 * summary["kernel_seconds"],
                 1e3 * summary["kernel_seconds"] / max(summary["passes"], 1), "100.0%"])
    return rows


CATEGORY_HEADERS = ["category", "kernels", "ms", "ms/pass", "share"]
