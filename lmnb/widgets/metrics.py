"""The metrics bar: time to first token, tokens/s, cache-hit share, jump-forward share, forward
passes, KV pool use and GPU memory, of a program run (`program_metrics`) or of a runtime
(`runtime_metrics`), as HTML (`metrics_html`, one line: inline styles only, so saved notebooks
show it as it was) and text (`metrics_text`)."""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.program import ProgramState
from lmnb.lang.token_trace import TokenTrace, trace_totals


@dataclass(frozen=True)
class Metrics:
    """None where unknown (e.g. GPU memory on a CPU runtime)."""

    ttft_s: float | None = None  # time to first token
    tokens_per_s: float | None = None  # output tokens per second of the run
    cache_hit_share: float | None = None  # prompt tokens served from the prefix cache
    jump_forward_share: float | None = None  # output tokens appended by jump-forward
    forward_passes: int | None = None
    kv_used_tokens: int | None = None
    kv_total_tokens: int | None = None
    gpu_allocated_gb: float | None = None
    gpu_total_gb: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _runtime_fields(stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """KV pool use and GPU memory from `Runtime.stats()`."""
    if not stats:
        return {}
    total = stats.get("max_total_tokens")
    fields: dict[str, Any] = {}
    if total:
        fields["kv_total_tokens"] = total
        fields["kv_used_tokens"] = total - stats.get("free_tokens", total)
    memory = stats.get("device_memory")
    if memory:
        fields["gpu_allocated_gb"] = memory.get("allocated_gb")
        fields["gpu_total_gb"] = memory.get("total_gb")
    return fields


def runtime_stats(state: ProgramState) -> dict[str, Any] | None:
    """`stats()` of the in-process runtime the state's program ran on, if it is still open."""
    backend = state.executor.backend
    if not isinstance(backend, LocalBackend):
        return None
    try:
        return backend.runtime.stats()
    except RuntimeError:  # closed or failed since
        return None


def _metas(state: ProgramState) -> Iterator[dict[str, Any]]:
    """The meta_info of every named gen of the run (each sample of n > 1), once each."""
    seen: set[int] = set()
    for executor in state.run.executors:
        for value in list(executor.meta_info.values()):
            for meta in value if isinstance(value, list) else [value]:
                if isinstance(meta, dict) and "completion_tokens" in meta \
                        and id(meta) not in seen:
                    seen.add(id(meta))
                    yield meta


def traced_metrics(traces: list[TokenTrace], stats: Mapping[str, Any] | None,
                   *, now: float | None = None) -> Metrics:
    """A traced run's metrics: every request counted once; the clock from the run's start."""
    totals = trace_totals(traces)
    log = traces[0].log
    ttft = tokens_per_s = None
    if log.first_token_at is not None:
        ttft = log.first_token_at - log.started_at
        end = log.last_token_at if now is None else now
        tokens_per_s = _ratio(totals["output_tokens"], end - log.started_at)
    return Metrics(ttft_s=ttft, tokens_per_s=tokens_per_s,
                   cache_hit_share=_ratio(totals["cached_tokens"], totals["prompt_tokens"]),
                   jump_forward_share=_ratio(totals["jump_forward_tokens"],
                                             totals["output_tokens"]),
                   forward_passes=totals["forward_passes"], **_runtime_fields(stats))


def program_metrics(state: ProgramState,
                    stats: Mapping[str, Any] | None = None) -> Metrics | None:
    """A program run's metrics: from its token trace when traced, else from its named gens'
    meta_info (time to first token of the first gen, tokens/s over the gens' latencies); None
    when it ran no gen it reports on."""
    traces = [e.token_trace for e in state.run.executors if e.token_trace is not None]
    if traces:
        return traced_metrics(traces, stats)
    metas = list(_metas(state))
    if not metas:
        return None
    first = next((m["first_token_latency"] for m in metas if "first_token_latency" in m), None)
    prompt = sum(m.get("prompt_tokens", 0) for m in metas)
    output = sum(m.get("completion_tokens", 0) for m in metas)
    latency = sum(m.get("e2e_latency", 0.0) for m in metas)
    jumped = sum(m.get("jump_forward_tokens", 0) for m in metas)  # none without a grammar
    return Metrics(ttft_s=first, tokens_per_s=_ratio(output, latency),
                   cache_hit_share=_ratio(sum(m.get("cached_tokens", 0) for m in metas), prompt),
                   jump_forward_share=_ratio(jumped, output),
                   forward_passes=sum(m.get("forward_passes", 0) for m in metas),
                   **_runtime_fields(stats))


def runtime_metrics(stats: Mapping[str, Any], tokens_per_s: float | None = None) -> Metrics:
    """A runtime's metrics since it started (`tokens_per_s`: measured by the caller between two
    polls)."""
    generated, jumped = stats.get("generated_tokens", 0), stats.get("jump_forward_tokens", 0)
    return Metrics(ttft_s=stats.get("mean_first_token_latency"), tokens_per_s=tokens_per_s,
                   cache_hit_share=_ratio(stats.get("cached_tokens", 0),
                                          stats.get("prompt_tokens", 0)),
                   jump_forward_share=_ratio(jumped, generated + jumped),
                   forward_passes=stats.get("forward_passes"), **_runtime_fields(stats))


# ---- rendering -------------------------------------------------------------------------------
def _items(m: Metrics) -> list[tuple[str, str, str]]:
    """(key, label, value) of each metric shown; unknown ones as "n/a", GPU memory only when
    known."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    items = [
        ("ttft", "time to first token", "n/a" if m.ttft_s is None else f"{1000 * m.ttft_s:.0f} ms"),
        ("tokens_per_s", "tokens/s", "n/a" if m.tokens_per_s is None else f"{m.tokens_per_s:.1f}"),
        ("cache_hit", "cache hits", pct(m.cache_hit_share)),
        ("jump_forward", "jump-forward", pct(m.jump_forward_share)),
        ("forward_passes", "forward passes",
         "n/a" if m.forward_passes is None else f"{m.forward_passes:,}"),
    ]
    if m.kv_total_tokens:
        used = m.kv_used_tokens or 0
        items.append(("kv_pool", "KV pool", f"{used:,} / {m.kv_total_tokens:,} "
                                            f"({100 * used / m.kv_total_tokens:.0f}%)"))
    if m.gpu_allocated_gb is not None:
        total = f" / {m.gpu_total_gb:.1f}" if m.gpu_total_gb else ""
        items.append(("gpu_memory", "GPU memory", f"{m.gpu_allocated_gb:.2f}{total} GiB"))
    return items


_BAR = ("display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;margin:4px 0;"
        "font-family:var(--jp-ui-font-family,sans-serif)")


def metrics_html(m: Metrics) -> str:
    """One line of HTML (no nested div: nbval's sanitizer drops it with one regex)."""
    cells = "".join(
        f'<span class="lmnb-metric" data-metric="{key}"><span style="opacity:.65">'
        f"{html.escape(label)}</span> <b>{html.escape(value)}</b></span>"
        for key, label, value in _items(m))
    return f'<div class="lmnb-metrics" style="{_BAR}">{cells}</div>'


def metrics_text(m: Metrics) -> str:
    """One line: `metrics: time to first token 12 ms · tokens/s 40.1 · ...`."""
    return "metrics: " + " · ".join(f"{label} {value}" for _, label, value in _items(m))
