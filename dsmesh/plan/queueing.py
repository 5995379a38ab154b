"""Latency percentiles from queues (docs/PLAN.md, "Percentiles"): the waiting time of an
M/D/1 queue with its Cramér-Lundberg tail, a step-time mixture's quantiles, and a closed
loop's fixed point (Little's law). Pure functions of floats; times in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

QUANTILES = (0.5, 0.9, 0.99)


def md1_mean_wait(rho: float, service_ms: float) -> float:
    """Pollaczek-Khinchine for deterministic service: W = rho·S / (2 (1 - rho))."""
    if rho <= 0:
        return 0.0
    if rho >= 1:
        return math.inf
    return rho * service_ms / (2.0 * (1.0 - rho))


def _decay(rho: float) -> float:
    """x = gamma·S > 0 with rho·(e^x - 1) = x: the tail's decay rate in units of the service."""

    def f(x: float) -> float:
        return rho * math.expm1(x) - x

    lo, hi = 1e-12, 1.0
    while f(hi) < 0:
        hi *= 2.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def md1_wait_quantile(rho: float, service_ms: float, q: float) -> float:
    """The q-quantile of an M/D/1 queue's waiting time at utilisation ``rho``.

    P(W > t) = min(rho, C·e^(-gamma·t)) (the Cramér-Lundberg tail of the M/G/1 queue), where
    rho·(e^(gamma·S) - 1) = gamma·S and C = (1 - rho) / (rho·e^(gamma·S) - 1). A request
    waits at all with probability rho, so quantiles below 1 - rho are 0."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1) (got {q})")
    if rho <= 1.0 - q or service_ms <= 0:
        return 0.0
    if rho >= 1:
        return math.inf
    x = _decay(rho)
    gamma = x / service_ms
    c = min(rho, (1.0 - rho) / (rho * math.exp(x) - 1.0))
    return max(0.0, math.log(c / (1.0 - q)) / gamma)


def mixture_quantile(points: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a discrete distribution given as (value, probability) pairs."""
    total = 0.0
    for value, prob in sorted(points):
        total += prob
        if total >= q - 1e-12:
            return value
    return max(v for v, _ in points)


def closed_loop_rate(
    clients: float, response_ms: Callable[[float], float], capacity: float
) -> tuple[float, float]:
    """The throughput X (requests/s) of ``clients`` that each send their next request when
    the last one ends: the fixed point X = clients / R(X) of Little's law, where
    ``response_ms(X)`` is the response time at X and grows with X. Below ``capacity``
    the fixed point is found by bisection; when even the capacity leaves clients over,
    they queue: X is the capacity and the second value is that queue's wait (ms)."""
    if clients <= 0 or capacity <= 0:
        raise ValueError("closed loop: need clients > 0 and a capacity > 0")
    top = capacity * (1.0 - 1e-6)
    r_top = response_ms(top)
    if top * r_top / 1e3 <= clients:
        return top, clients * 1e3 / top - r_top
    lo, hi = 0.0, top
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid * response_ms(mid) / 1e3 < clients:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2, 0.0
