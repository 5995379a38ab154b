"""What the serving benchmark reads from a running mesh's Prometheus endpoints: the gateway's
handoff counters (per request handoff time and KV bytes/s over a run), each engine instance's
gauges sampled on a thread during a run (where requests wait), and the KV pages per copy run
of the handoffs. Where each instance serves its metrics is read from the mesh's own ready
summary, as a user reads it."""

from __future__ import annotations

import contextlib
import re
import threading
import urllib.request
from collections.abc import Iterable

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
HANDOFF_METRICS = (
    "dsmesh_kv_handoff_seconds_sum",
    "dsmesh_kv_handoff_seconds_count",
    "dsmesh_kv_transfer_bytes_total",
    "dsmesh_kv_write_seconds_total",
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labels summed (the few we read have none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# An engine instance's line in ``dsmesh up``'s ready summary (``--instance-metrics-port``):
# "  metrics  prefill-0    http://127.0.0.1:9100/metrics", the label on the first line only.
_INSTANCE_METRICS = re.compile(
    r"^\s+(?:metrics\s+)?((?:prefill|decode|unified)-\d+)\s+(http://\S+/metrics)\s*$"
)


def instance_metrics_urls(summary: Iterable[str]) -> dict[str, str]:
    """Each engine instance's /metrics URL, by name, from the lines of ``dsmesh up``'s ready
    summary (read from the running mesh, so the ports are those it serves); empty when it
    runs without ``--instance-metrics-port``."""
    return {
        m.group(1): m.group(2) for line in summary if (m := _INSTANCE_METRICS.match(line.rstrip()))
    }


def scrape(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return parse_metrics(resp.read().decode())
    except OSError:
        return {}


def handoff_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request handoff time (what the KV handoff added to TTFT) and KV bytes/s over a
    run, from the deltas of the gateway's counters."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in HANDOFF_METRICS}
    count = d["dsmesh_kv_handoff_seconds_count"]
    write_s = d["dsmesh_kv_write_seconds_total"]
    nbytes = d["dsmesh_kv_transfer_bytes_total"]
    return {
        "handoffs": count,
        "handoff_ms_mean": d["dsmesh_kv_handoff_seconds_sum"] / count * 1e3 if count else 0.0,
        "kv_bytes_per_request": nbytes / count if count else 0.0,
        "kv_GBps": nbytes / write_s / 1e9 if write_s > 0 else 0.0,
    }


# Each engine instance's gauges sampled during a run: where the requests wait.
INSTANCE_GAUGES = (
    "dsmesh_requests_running",
    "dsmesh_requests_waiting",  # prefill / unified: queued; decode: waiting for KV
    "dsmesh_requests_in_line",  # decode: in line for pages and a slot
)
PAGE_COUNTERS = ("dsmesh_kv_transfer_pages_total", "dsmesh_kv_transfer_page_runs_total")


class GaugeSampler:
    """Scrapes every engine instance's /metrics every ``period_s`` on a thread while the
    block runs; :meth:`summary` gives each gauge's mean and max per instance."""

    def __init__(self, urls: dict[str, str], period_s: float = 0.25) -> None:
        self.urls = urls
        self.period_s = period_s
        self.samples: dict[str, dict[str, list[float]]] = {name: {} for name in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, url in self.urls.items():
                got = scrape(url)
                for gauge in INSTANCE_GAUGES:
                    if gauge in got:
                        self.samples[name].setdefault(gauge, []).append(got[gauge])

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            name: {
                gauge.removeprefix("dsmesh_requests_"): {
                    "mean": sum(values) / len(values),
                    "max": max(values),
                }
                for gauge, values in gauges.items()
                if values
            }
            for name, gauges in self.samples.items()
        }


def pages_per_run(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> float:
    """KV pages written per run of pages consecutive on both sides, over all prefills, from
    their counters' deltas (1.0: every page its own copy per layer; 0.0: nothing written)."""
    pages, runs = (
        sum(after[n].get(c, 0.0) - before[n].get(c, 0.0) for n in after) for c in PAGE_COUNTERS
    )
    return pages / runs if runs else 0.0
