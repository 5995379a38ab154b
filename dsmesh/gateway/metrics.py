"""The gateway's Prometheus metrics (documented in docs/OBSERVABILITY.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dsmesh.gateway.routing import REASONS
from dsmesh.v1 import prefill_pb2

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class _KVPages(Collector):
    """KV page gauges summed over decode and unified instances, read at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        used, free = self._read()
        yield GaugeMetricFamily(
            "dsmesh_kv_pages_used",
            "KV pages held by requests, summed over decode and unified instances",
            value=used,
        )
        yield GaugeMetricFamily(
            "dsmesh_kv_pages_free",
            "free KV pages, summed over decode and unified instances",
            value=free,
        )


class GatewayMetrics:
    def __init__(self, kv_pages: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "dsmesh_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "dsmesh_itl_seconds", "inter-token latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "dsmesh_e2e_latency_seconds",
            "request latency, first byte in to last token out",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dsmesh_prompt_tokens", "prompt tokens of admitted requests", registry=r
        )
        self.generated_tokens = Counter(
            "dsmesh_generated_tokens", "tokens generated and sent to clients", registry=r
        )
        self.cached_tokens = Counter(
            "dsmesh_prefix_cache_hit_tokens",
            "prompt tokens of finished requests that a prefix cache served, as the instances "
            "reported",
            registry=r,
        )
        self.routing = Counter(
            "dsmesh_routing_decisions",
            "requests dispatched, by why their target was chosen (KV-aware routing)",
            ["reason"],
            registry=r,
        )
        for reason in REASONS:
            self.routing.labels(reason)  # every reason shows, from 0
        self.requests = Counter(
            "dsmesh_requests", "finished requests by outcome", ["outcome"], registry=r
        )
        self.requeued = Counter(
            "dsmesh_requests_requeued",
            "requests an instance refused for room before doing any work (decode's "
            "--reserve-wait), put back at the head of the gateway's queue",
            registry=r,
        )
        self.migrated = Counter(
            "dsmesh_requests_migrated",
            "requests sent on to another instance after the one serving them was lost "
            "(--migration-limit, docs/RELIABILITY.md); lost: the role that failed",
            ["lost"],
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "dsmesh_kv_handoff_seconds",
            "what each request's KV handoff added to its TTFT (prefill's last forward to its "
            "commit)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "dsmesh_kv_transfer_bytes", "KV bytes prefill wrote into decode's pages", registry=r
        )
        self.write_seconds = Counter(
            "dsmesh_kv_write_seconds", "time prefill spent writing those bytes", registry=r
        )
        self.running = Gauge("dsmesh_requests_running", "requests streaming tokens", registry=r)
        self.waiting = Gauge(
            "dsmesh_requests_waiting",
            "requests waiting for their first token (queued at the gateway or dispatched)",
            registry=r,
        )
        self.queued = Gauge(
            "dsmesh_requests_queued",
            "requests waiting in the gateway's admission queue for an instance with room",
            registry=r,
        )
        r.register(_KVPages(kv_pages))

    def kv_handoff(self, answer: prefill_pb2.PrefillResponse) -> None:
        """Record one request's handoff from prefill's answer."""
        self.handoff_seconds.observe(answer.handoff_us / 1e6)
        self.transfer_bytes.inc(answer.kv_bytes)
        self.write_seconds.inc(answer.kv_write_us / 1e6)
