"""Prometheus metrics of one EPLB controller, in a registry of its own (several controllers
per process in tests must not collide in the global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EPLBMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.balancedness = Gauge(
            "dsmesh_expert_balancedness",
            "Mean over max of per-rank MoE load (1 = perfectly balanced). when=before/after: "
            "predicted for the placement in effect before/after the latest decision, on the "
            "window's load; when=measured: the tokens the ranks actually received",
            ["instance", "when"],
            registry=self.registry,
        )
        self.rebalances_total = Counter(
            "dsmesh_eplb_rebalances_total",
            "Placements applied (pushed as a new version)",
            ["instance"],
            registry=self.registry,
        )
        self.placement_version = Gauge(
            "dsmesh_eplb_placement_version",
            "Latest placement version pushed to the instance",
            ["instance"],
            registry=self.registry,
        )
        self.applied_version = Gauge(
            "dsmesh_eplb_applied_version",
            "Latest placement version the instance reports running",
            ["instance"],
            registry=self.registry,
        )
        self.swap_seconds = Histogram(
            "dsmesh_eplb_swap_seconds",
            "Time instances spent swapping expert weights to a new placement",
            ["instance"],
            buckets=SWAP_BUCKETS,
            registry=self.registry,
        )

    def decided(self, instance: str, before: float, after: float, applied: bool) -> None:
        self.balancedness.labels(instance=instance, when="before").set(before)
        self.balancedness.labels(instance=instance, when="after").set(after if applied else before)

    def measured(self, instance: str, value: float) -> None:
        self.balancedness.labels(instance=instance, when="measured").set(value)

    def pushed(self, instance: str, version: int) -> None:
        self.rebalances_total.labels(instance=instance).inc()
        self.placement_version.labels(instance=instance).set(version)

    def applied(self, instance: str, version: int, swap_seconds: float) -> None:
        self.applied_version.labels(instance=instance).set(version)
        self.swap_seconds.labels(instance=instance).observe(swap_seconds)
