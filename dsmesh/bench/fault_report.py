"""The fault benchmark's figures (dsmesh/bench/faults.py), from its two runs' records and what
the supervisor printed: the supervisor's ready, exit and restart lines parsed, the output rate
in sliding windows and when it came back after the kill, each run's figures, the comparison
and the table. Pure functions."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsmesh.bench.serving_stats import BenchSummary, RequestRecord

# ``dsmesh up``'s lines (dsmesh/cli/supervisor.py): a first start, a death, a restart
READY_LINE = re.compile(r"^\s+(\S+)\s+ready at (\S+)\s+pid (\d+)\s+([\d.]+)s")
EXIT_LINE = re.compile(r"(\S+) exited with code (-?\d+) after [\d.]+s; restarting in ([\d.]+)s")
RESTART_LINE = re.compile(r"(\S+) restarted at (\S+) \(pid (\d+)\), (healthy|NOT healthy yet)")


@dataclass(frozen=True)
class SupervisorLine:
    """One line of ``dsmesh up`` that the benchmark acts on."""

    kind: str  # "ready", "exit" or "restart"
    service: str  # e.g. "decode-0", "kv-broker"
    pid: int = 0  # ready, restart: the process now serving
    seconds: float = 0.0  # ready: launch to healthy; exit: the delay before the restart
    healthy: bool = True  # restart: healthy when the supervisor printed it


def parse_supervisor_line(line: str) -> SupervisorLine | None:
    """The ready / exit / restart line ``line`` is, or None."""
    if m := READY_LINE.match(line):
        return SupervisorLine("ready", m.group(1), int(m.group(3)), float(m.group(4)))
    if m := EXIT_LINE.search(line):
        return SupervisorLine("exit", m.group(1), seconds=float(m.group(3)))
    if m := RESTART_LINE.search(line):
        return SupervisorLine(
            "restart", m.group(1), int(m.group(3)), healthy=m.group(4) == "healthy"
        )
    return None


def delivered_tokens(records: Sequence[RequestRecord]) -> tuple[list[float], list[int]]:
    """Every token-bearing message the client got (failed requests' included: they were
    served), as arrival times in ascending order and the running total of tokens up to and
    including each."""
    arrivals = sorted(
        (t, k) for r in records for t, k in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
    )
    times, totals, total = [], [], 0
    for t, k in arrivals:
        total += k
        times.append(t)
        totals.append(total)
    return times, totals


def tokens_between(times: Sequence[float], totals: Sequence[int], start: float, end: float) -> int:
    """Tokens that arrived in ``[start, end)``; ``times``/``totals`` from
    :func:`delivered_tokens`."""
    lo = bisect.bisect_left(times, start)
    hi = bisect.bisect_left(times, end)
    before = totals[lo - 1] if lo > 0 else 0
    upto = totals[hi - 1] if hi > 0 else 0
    return upto - before


@dataclass(frozen=True)
class Recovery:
    """The output rate after the kill, against the undisturbed run's.

    ``recovered_after_s``: from the kill to the start of the first ``window_s`` window,
    starting at or after the kill, whose output rate is at least ``fraction`` of the reference
    (0.0 when the first such window is the one right at the kill: no dip); None when no such
    window ends within the run. ``lowest_fraction``: the lowest window rate after the kill as a
    fraction of the reference (nan when the run ended less than a window after the kill).
    """

    reference_tok_s: float
    window_s: float
    fraction: float
    recovered_after_s: float | None
    lowest_fraction: float


def recovery(
    records: Sequence[RequestRecord],
    kill_s: float,
    end_s: float,
    reference_tok_s: float,
    window_s: float,
    fraction: float,
    step_s: float | None = None,
) -> Recovery:
    """Slide a ``window_s`` window from the kill (``kill_s``, run time) to the run's end
    (``end_s``) in steps of ``step_s`` (default a tenth of the window) over the tokens of
    ``records``; see :class:`Recovery`."""
    step = step_s if step_s is not None else window_s / 10
    times, totals = delivered_tokens(records)
    recovered: float | None = None
    lowest = math.inf
    num_steps = math.floor((end_s - window_s - kill_s) / step + 1e-9) + 1
    for i in range(max(0, num_steps)):
        start = kill_s + i * step
        rate = tokens_between(times, totals, start, start + window_s) / window_s
        lowest = min(lowest, rate)
        if recovered is None and rate >= fraction * reference_tok_s:
            recovered = start - kill_s
    lowest_fraction = lowest / reference_tok_s if math.isfinite(lowest) else math.nan
    return Recovery(reference_tok_s, window_s, fraction, recovered, lowest_fraction)


def timeline(records: Sequence[RequestRecord], duration_s: float, window_s: float) -> list[float]:
    """Tokens/s the client got in consecutive ``window_s`` windows from the run's start (the
    last one as wide as what is left of the run)."""
    times, totals = delivered_tokens(records)
    rates, start = [], 0.0
    while start < duration_s:
        end = min(start + window_s, duration_s)
        rates.append(tokens_between(times, totals, start, end) / (end - start))
        start = end
    return rates


def delivered_rate(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Tokens the client got per second over a whole run (the reference of :func:`recovery`)."""
    _, totals = delivered_tokens(records)
    return (totals[-1] if totals else 0) / duration_s if duration_s > 0 else math.nan


def run_figures(records: Sequence[RequestRecord], summary: BenchSummary) -> dict[str, Any]:
    """One run's figures: requests by outcome, tokens, throughput, TTFT and E2E (ms, over the
    requests that succeeded)."""
    return {
        "requests": len(records),
        "ok": summary.completed,
        "failed": summary.failed,
        "refused": summary.refused,
        "timed_out": summary.timed_out,
        "output_tokens": summary.total_output_tokens,
        "duration_s": summary.duration_s,
        "output_tok_s": summary.output_throughput,
        "delivered_tok_s": delivered_rate(records, summary.duration_s),
        # when the last failed request ended, in run time (None: none failed)
        "last_failure_s": max((r.send_s + r.e2e_s for r in records if not r.success), default=None),
        "failures": failures(records),
        "ttft_ms": {"p50": summary.ttft_ms.p50, "p99": summary.ttft_ms.p99},
        "e2e_ms": {"p50": summary.e2e_ms.p50, "p99": summary.e2e_ms.p99},
    }


def first_served_after(records: Sequence[RequestRecord], kill_s: float) -> float | None:
    """From ``kill_s`` to the first token of the first request sent at or after it that
    succeeded (run time); None if none did."""
    served = [
        r.send_s + r.ttft_s
        for r in records
        if r.success and r.ttft_s is not None and r.send_s >= kill_s
    ]
    return min(served) - kill_s if served else None


def failures(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests by the start of their error (the status and who answered, e.g.
    ``UNAVAILABLE: decode``), most frequent first."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = ":".join(r.error.split(":")[:2]).strip() or r.outcome
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def comparison(undisturbed: dict[str, Any], faulted: dict[str, Any]) -> dict[str, float]:
    """Faulted over undisturbed, for each latency percentile."""
    return {
        f"{name}_{q}": ratio(faulted[name][q], undisturbed[name][q])
        for name in ("ttft_ms", "e2e_ms")
        for q in ("p50", "p99")
    }


def within(value: float, bound: float | None) -> bool | None:
    """``value <= bound``; None when either is unknown (no restart seen, no request ok)."""
    if bound is None or not math.isfinite(value):
        return None
    return value <= bound


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return fmt.format(value) if isinstance(value, float) else str(value)


def format_table(result: dict[str, Any]) -> str:
    """The human table: the two runs side by side, then what the fault cost."""
    u, f = result["undisturbed"], result["faulted"]
    kill, rec = result["kill"], result["recovery"]
    rows = [
        ("requests ok / failed", f"{u['ok']} / {u['failed']}", f"{f['ok']} / {f['failed']}"),
        ("  of which refused, timed out", f"{u['refused']}, {u['timed_out']}",
         f"{f['refused']}, {f['timed_out']}"),
        ("requests migrated", "-", _num(result["migrated"])),
        ("output tok/s (whole run)", _num(u["output_tok_s"]), _num(f["output_tok_s"])),
        ("duration (s)", _num(u["duration_s"], "{:.2f}"), _num(f["duration_s"], "{:.2f}")),
    ]  # fmt: skip
    for name, label in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E")):
        for q in ("p50", "p99"):
            rows.append((f"{label} {q} (ms)", _num(u[name][q]), _num(f[name][q])))
    width = max(len(r[0]) for r in rows) + 2
    lines = [
        "{:=^64}".format(" Fault Benchmark Result "),
        f"{'':<{width}}{'undisturbed':>14}{'faulted':>14}",
        *(f"{label:<{width}}{a:>14}{b:>14}" for label, a, b in rows),
        "-" * 64,
        f"SIGKILL {kill['service']} (pid {kill['pid']}) at {kill['at_s']:.2f} s into the run",
        f"restarted (SIGKILL to healthy): {_num(kill['restart_s'], '{:.2f} s')}"
        f" (supervisor's delay {_num(kill['restart_delay_s'], '{:.1f} s')};"
        f" first start took {_num(kill['first_start_s'], '{:.1f} s')})",
        "output rate back to {:.0f}% of undisturbed ({:.0f} tok/s, {:g} s windows): {}".format(
            rec["fraction"] * 100,
            rec["reference_tok_s"],
            rec["window_s"],
            _num(rec["recovered_after_s"], "{:.2f} s after the kill")
            if rec["recovered_after_s"] is not None
            else "not within the run",
        ),
        f"lowest window after the kill: {_num(rec['lowest_fraction'] * 100, '{:.0f}%')}"
        " of undisturbed",
        "a request sent after the kill served (first token): "
        + _num(result["serving_again_s"], "{:.2f} s after the kill")
        + (" (a probe after the run)" if result["serving_again_probe"] else ""),
        "failed: "
        + (", ".join(f"{n} {k}" for k, n in f["failures"].items()) or "none")
        + (
            f"; the last ended {f['last_failure_s'] - kill['at_s']:.2f} s after the kill"
            if f["last_failure_s"] is not None
            else ""
        ),
        f"p99 E2E {_num(result['ratios']['e2e_ms_p99'], '{:.2f}x')} undisturbed"
        f" (1.5x + the restart: {_num(result['e2e_p99_bound_ms'], '{:.0f} ms')}"
        + {True: ", within it)", False: ", NOT within it)", None: ")"}[
            result["e2e_p99_within_bound"]
        ],
        "faulted run, tok/s per window: "
        + " ".join(f"{x:.0f}" for x in result["timeline_tok_s"]["faulted"]),
        f"KV pages in use after: {_num(result['kv_pages_used_after'])} (gateway), "
        + (
            ", ".join(f"{k} {_num(v)}" for k, v in result["instance_pages_used_after"].items())
            or "no instance metrics"
        ),
        "=" * 64,
    ]
    return "\n".join(lines)
