"""Prometheus metrics of a prefill or decode instance, served on ``--metrics-port``.

Gauges are read from the engine's :meth:`~dsmesh.engine.llm_engine.LLMEngine.load` at scrape time
(safe from the HTTP thread); counters and histograms are updated where things happen. Each
instance has its own registry so tests can run several in one process. Names:
docs/OBSERVABILITY.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.engine.sched.load_report import EngineLoad

log = logging.getLogger(__name__)

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


Waiting = Callable[[EngineLoad], int]


def queued(load: EngineLoad) -> int:
    """Requests queued in the engine for admission (prefill, unified)."""
    return load.num_waiting


class _EngineGauges(Collector):
    def __init__(
        self, engine: LLMEngine, role: str, waiting: Waiting, in_line: Callable[[], int] | None
    ) -> None:
        self.engine = engine
        self.role = role
        self.waiting = waiting
        self.in_line = in_line

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self.engine.load()
        labels = ["role"]
        for name, doc, value in (
            ("dsmesh_kv_pages_used", "KV pages held by requests", load.used_pages),
            (
                "dsmesh_kv_pages_free",
                "KV pages free (idle prefix-cache pages count as free)",
                load.free_pages,
            ),
            ("dsmesh_requests_running", "requests in the running batch", load.num_running),
            (
                "dsmesh_requests_waiting",
                "requests queued or waiting for their KV",
                self.waiting(load),
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.role], value)
            yield family
        if self.in_line is not None:
            family = GaugeMetricFamily(
                "dsmesh_requests_in_line",
                "requests in line for KV pages and a running slot (decode)",
                labels=labels,
            )
            family.add_metric([self.role], self.in_line())
            yield family
        family = GaugeMetricFamily(
            "dsmesh_startup_seconds",
            "seconds of each phase of this process's start-up (imports, weights, kv_pool, "
            "kernels, graphs, transfer, server; docs/RELIABILITY.md, Restart time)",
            labels=["role", "phase"],
        )
        for phase, seconds in self.engine.startup.phases.items():
            family.add_metric([self.role, phase], seconds)
        yield family


class _CacheCounters(Collector):
    """The prefix cache's counters and the scheduler's retractions, read at scrape time
    (plain ints the engine thread updates: safe to read from the HTTP thread)."""

    def __init__(self, engine: LLMEngine, role: str) -> None:
        self.engine = engine
        self.role = role

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.engine.stats
        rows: list[tuple[type, str, str, float]] = [
            (
                CounterMetricFamily,
                "dsmesh_retractions",
                "requests taken out of the running batch for lack of KV pages",
                stats.num_retractions,
            ),
            (
                CounterMetricFamily,
                "dsmesh_retracted_tokens",
                "computed tokens the retracted requests gave up (recomputed, less cache hits)",
                stats.num_retracted_tokens,
            ),
            (
                CounterMetricFamily,
                "dsmesh_kv_reserved_ahead_tokens",
                "tokens whose KV pages admission took before the request had them (PD "
                "prefill: its first new token; 0 where pages follow the tokens)",
                stats.num_reserved_ahead_tokens,
            ),
        ]
        cache = self.engine.scheduler.prefix_cache
        if cache is not None:
            c = cache.stats()
            rows += [
                (
                    CounterMetricFamily,
                    "dsmesh_prefix_cache_lookup_tokens",
                    "prompt tokens looked up in the prefix cache at admission",
                    c.num_lookup_tokens,
                ),
                (
                    CounterMetricFamily,
                    "dsmesh_prefix_cache_hit_tokens",
                    "of those, tokens served from the prefix cache",
                    c.num_hit_tokens,
                ),
                (
                    GaugeMetricFamily,
                    "dsmesh_prefix_cache_hit_rate",
                    "hit tokens / lookup tokens since the instance started",
                    c.hit_rate,
                ),
                (
                    GaugeMetricFamily,
                    "dsmesh_prefix_cache_pages",
                    "KV pages the prefix cache holds (in use or idle)",
                    c.num_cached_pages,
                ),
                (
                    CounterMetricFamily,
                    "dsmesh_prefix_cache_evicted_pages",
                    "idle cached pages evicted to make room",
                    c.num_evicted_pages,
                ),
                (
                    CounterMetricFamily,
                    "dsmesh_prefix_waits",
                    "admissions put off a step while a running request computed the same "
                    "prompt prefix, to take it from the cache",
                    stats.num_prefix_waits,
                ),
            ]
        for kind, name, doc, value in rows:
            family = kind(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family


class _SpecCounters(Collector):
    """Speculative decoding (MTP): drafts, accepted drafts, and the tokens each verification
    emitted (accepted drafts + the target's own token), read at scrape time. Nothing when
    the engine does not speculate."""

    def __init__(self, engine: LLMEngine, role: str) -> None:
        self.engine = engine
        self.role = role

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        stats = self.engine.spec_stats
        if stats is None:
            return
        for name, doc, value in (
            ("dsmesh_spec_draft_tokens", "tokens drafted by the MTP layer", stats.num_draft_tokens),
            (
                "dsmesh_spec_accepted_tokens",
                "drafted tokens the target model accepted",
                stats.num_accepted_tokens,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        buckets, total = [], 0
        for accepted, count in enumerate(stats.accepted_histogram):
            total += count
            buckets.append((str(float(accepted + 1)), total))
        buckets.append(("+Inf", total))
        emitted = stats.num_verifications + stats.num_accepted_tokens
        family = HistogramMetricFamily(
            "dsmesh_spec_acceptance_length",
            "tokens one verification emitted: accepted drafts + the target's token",
            labels=["role"],
        )
        family.add_metric([self.role], buckets, sum_value=emitted)
        yield family


class InstanceMetrics:
    """``waiting``: the requests-waiting gauge, from the engine's load (default: its queue);
    ``in_line``: decode's requests in line for pages (``dsmesh_requests_in_line``)."""

    def __init__(
        self,
        engine: LLMEngine,
        role: str,
        waiting: Waiting = queued,
        in_line: Callable[[], int] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineGauges(engine, role, waiting, in_line))
        r.register(_CacheCounters(engine, role))
        r.register(_SpecCounters(engine, role))
        self.prompt_tokens = Counter(
            "dsmesh_prompt_tokens",
            "prompt tokens computed (prefill) or received (decode)",
            registry=r,
        )
        self.generated_tokens = Counter("dsmesh_generated_tokens", "tokens generated", registry=r)
        self.transfer_bytes = Counter(
            "dsmesh_kv_transfer_bytes", "KV bytes written into decode pages", registry=r
        )
        self.transfer_pages = Counter(
            "dsmesh_kv_transfer_pages", "KV pages written into decode pages", registry=r
        )
        self.transfer_page_runs = Counter(
            "dsmesh_kv_transfer_page_runs",
            "runs of pages consecutive on both sides among them: one copy per layer each "
            "(pages / runs near 1: scattered pages, a copy per page)",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "dsmesh_kv_transfer_seconds",
            "time of one KV chunk write (all layers)",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "dsmesh_kv_handoff_seconds",
            "end of a request's last forward to its commit: what the KV handoff adds to TTFT",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.handoffs = Counter(
            "dsmesh_kv_handoffs_seen", "KV handoffs ended, by final state", ["state"], registry=r
        )
        self.skipped_pages = Counter(
            "dsmesh_kv_handoff_skipped_pages",
            "prompt pages of DONE handoffs that decode's prefix cache held: not written",
            registry=r,
        )
        self.skipped_bytes = Counter(
            "dsmesh_kv_handoff_skipped_bytes",
            "KV bytes of those pages (all layers): what the transfer did not move",
            registry=r,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0 = any free port); returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]


def start_metrics(
    engine: LLMEngine,
    role: str,
    port: int,
    host: str,
    waiting: Waiting = queued,
    in_line: Callable[[], int] | None = None,
) -> InstanceMetrics | None:
    """An instance's metrics, served on ``port`` at ``host``; None when ``port`` is 0
    (``--metrics-port`` off)."""
    if not port:
        return None
    metrics = InstanceMetrics(engine, role, waiting, in_line)
    bound = metrics.serve(port, host)
    log.info("%s metrics on http://%s:%d/metrics", role, host, bound)
    return metrics
