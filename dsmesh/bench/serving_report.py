"""The serving benchmark's report, from a run's records and summary: the sglang-style table,
the first failures, the JSON (``--json``, with ``--json-details`` one object per request)
and a PNG of latency CDFs and output throughput over time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dsmesh.bench.serving_config import BenchConfig
from dsmesh.bench.serving_stats import BenchRun, BenchSummary, RequestRecord, tokens_per_bin

MAX_ERRORS_SHOWN = 5


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value}"


def format_summary(config: BenchConfig, summary: BenchSummary) -> str:
    """The sglang-style result table."""
    s = summary
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _row("Backend:", f"{config.backend} ({config.target})"),
        _row("Traffic request rate:", rate),
        _row("Max request concurrency:", config.max_concurrency or "not set"),
        _row("Successful requests:", s.completed),
        _row("Failed requests:", s.failed),
        _row("  of which refused (429):", s.refused),
        _row("  of which timed out:", s.timed_out),
        _row("Benchmark duration (s):", s.duration_s),
        _row("Total input tokens:", s.total_input_tokens),
        _row("Total generated tokens:", s.total_output_tokens),
        _row("Output tokens per request (mean):", s.output_tokens.mean),
        _row("Output tokens per request (max):", s.output_tokens.max),
        _row(
            "Finish reasons:",
            ", ".join(f"{k or 'none'} {v}" for k, v in s.finish_reasons.items()) or "n/a",
        ),
        _row("Total cached prompt tokens:", s.total_cached_tokens),
        _row("Mean cached tokens per request:", s.mean_cached_tokens),
        _row("Prompt cache hit rate (%):", s.cache_hit_rate * 100),
        *(
            []
            if math.isnan(s.spec_mean_acceptance_length)
            else [
                _row("Draft acceptance rate (%):", s.spec_acceptance_rate * 100),
                _row("Mean acceptance length:", s.spec_mean_acceptance_length),
            ]
        ),
        _row("Request throughput (req/s):", s.request_throughput),
        _row("Input token throughput (tok/s):", s.input_throughput),
        _row("Output token throughput (tok/s):", s.output_throughput),
        _row("Total token throughput (tok/s):", s.total_throughput),
        _row("Concurrency:", s.concurrency),
    ]
    sections = [
        ("End-to-End Latency", "E2E Latency", s.e2e_ms),
        ("Time to First Token", "TTFT", s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms),
        ("Inter-Token Latency", "ITL", s.itl_ms),
    ]
    for title, name, dist in sections:
        lines.append(f"{title:-^50}")
        lines.append(_row(f"Mean {name} (ms):", dist.mean))
        lines.append(_row(f"P50 {name} (ms):", dist.p50))
        lines.append(_row(f"P90 {name} (ms):", dist.p90))
        lines.append(_row(f"P99 {name} (ms):", dist.p99))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(records: Sequence[RequestRecord], limit: int = MAX_ERRORS_SHOWN) -> str:
    """The first ``limit`` failures, one line each; empty when all succeeded."""
    failed = [r for r in records if not r.success]
    lines = [f"request {r.index}: {r.error}" for r in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more failed requests")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no nan: empty statistics become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def result_json(
    config: BenchConfig, summary: BenchSummary, run: BenchRun, details: bool
) -> dict[str, Any]:
    """Everything the table shows, plus the config and the first errors; with ``details``
    also one object per request."""
    out: dict[str, Any] = {
        "config": _finite(dataclasses.asdict(config)),
        "summary": _finite(dataclasses.asdict(summary)),
        "errors": [
            {"index": r.index, "error": r.error}
            for r in [r for r in run.records if not r.success][:MAX_ERRORS_SHOWN]
        ],
    }
    if details:
        out["requests"] = [_finite(dataclasses.asdict(r)) for r in run.records]
    return out


def plot_results(run: BenchRun, path: str | Path, bin_s: float = 1.0) -> None:
    """One PNG: CDFs of TTFT, ITL and E2E (ms), and output tokens/s over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in run.records if r.success]
    samples = {
        "TTFT": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
        "ITL": [x * 1e3 for r in ok for x in r.itl_s],
        "E2E latency": [r.e2e_s * 1e3 for r in ok],
    }
    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flat
    for ax, (name, values) in zip(axes, samples.items(), strict=False):
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), drawstyle="steps-post")
        ax.set(title=f"{name} CDF (n={len(xs)})", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    times = [t for r in ok for t in r.chunk_times_s]
    counts = [k for r in ok for k in r.chunk_tokens]
    bins = tokens_per_bin(times, counts, run.duration_s, bin_s)
    starts = [i * bin_s for i in range(len(bins))]
    # the last bin ends with the run: divide by its real width, not bin_s
    widths = [min(bin_s, max(run.duration_s - t, 1e-9)) for t in starts]
    ax = fig.axes[3]
    ax.bar(starts, [b / w for b, w in zip(bins, widths, strict=True)], width=widths, align="edge")
    ax.set(title=f"Output throughput ({bin_s:g} s bins)", xlabel="s since start", ylabel="tok/s")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{len(ok)} requests, {run.duration_s:.2f} s")
    fig.savefig(path, dpi=100)
