"""Prometheus metrics of one broker, in a registry of its own (several brokers per process
in tests must not collide in the global registry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from dsmesh.kv_broker.state import HandoffState, Transition

ROLE_LABELS = ("prefill", "decode", "unified")


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.handoffs_total = Counter(
            "dsmesh_kv_handoffs_total",
            "KV handoffs that entered each state",
            ["state"],
            registry=self.registry,
        )
        self.handoffs_active = Gauge(
            "dsmesh_kv_handoffs_active",
            "KV handoffs not yet in a terminal state (RESERVED or TRANSFERRING)",
            registry=self.registry,
        )
        self.instances_attached = Gauge(
            "dsmesh_kv_instances_attached",
            "Instances with an open Attach stream",
            ["role"],
            registry=self.registry,
        )
        for state in HandoffState:
            self.handoffs_total.labels(state=state.name.lower())
        for role in ROLE_LABELS:
            self.instances_attached.labels(role=role).set(0)

    def record(self, transitions: Iterable[Transition], num_active: int) -> None:
        for t in transitions:
            if t.state_changed:
                self.handoffs_total.labels(state=t.new_state.name.lower()).inc()
        self.handoffs_active.set(num_active)

    def set_attached(self, num_by_role: Mapping[str, int]) -> None:
        for role in ROLE_LABELS:
            self.instances_attached.labels(role=role).set(num_by_role.get(role, 0))
