"""Percentiles and the closed loop (dsmesh/plan/queueing.py, dsmesh/plan/closed_loop.py):
against a simulated M/D/1 queue, by hand, and against Little's law."""

from __future__ import annotations

import random

import pytest

from dsmesh.plan.closed_loop import unified_rank_at
from dsmesh.plan.costs import Parallel
from dsmesh.plan.hardware import H200
from dsmesh.plan.queueing import (
    closed_loop_rate,
    md1_mean_wait,
    md1_wait_quantile,
    mixture_quantile,
)
from dsmesh.plan.search import Target
from dsmesh.plan.shapes import V2_LITE
from dsmesh.plan.simulate import Simulator, Workload


def _lindley(rho: float, n: int = 200_000) -> list[float]:
    """Waiting times of an M/D/1 queue, service 1, request by request."""
    rng, wait, out = random.Random(7), 0.0, []
    for _ in range(n):
        wait = max(0.0, wait + 1.0 - rng.expovariate(rho))
        out.append(wait)
    return sorted(out)


@pytest.mark.parametrize("rho", [0.6, 0.9])
def test_md1_tail_matches_a_simulated_queue(rho: float) -> None:
    """The Cramér-Lundberg tail runs up to 11% short at p90 and 60% load (docs/PLAN.md)."""
    waits = _lindley(rho)
    assert sum(waits) / len(waits) == pytest.approx(md1_mean_wait(rho, 1.0), rel=0.06)
    for q in (0.9, 0.99):
        simulated = waits[int(q * len(waits))]
        assert md1_wait_quantile(rho, 1.0, q) == pytest.approx(simulated, rel=0.12)


def test_md1_quantiles_below_the_idle_share_are_zero() -> None:
    """A request waits at all with probability rho."""
    assert md1_wait_quantile(0.3, 5.0, 0.5) == 0.0
    assert md1_wait_quantile(0.3, 5.0, 0.9) > 0.0
    with pytest.raises(ValueError, match="quantile"):
        md1_wait_quantile(0.5, 1.0, 1.0)


def test_mixture_quantile() -> None:
    mix = [(10.0, 0.85), (40.0, 0.15)]
    assert [mixture_quantile(mix, q) for q in (0.5, 0.9, 0.99)] == [10.0, 40.0, 40.0]


def test_closed_loop_is_littles_law() -> None:
    """R(X) = 100 ms + X ms: 30 clients settle where X·R(X) = 30 (X = 100 req/s, R = 0.3 s)."""
    x, queue = closed_loop_rate(30, lambda x: 100.0 + 1e3 * x / 500, capacity=1e6)
    assert x == pytest.approx(100.0, rel=1e-6) and queue == 0.0
    # a capacity of 50 req/s leaves clients over: they queue for the rest of 30 / 50 s
    x, queue = closed_loop_rate(30, lambda x: 100.0, capacity=50.0)
    assert x == pytest.approx(50.0, rel=1e-5)
    assert queue == pytest.approx(30 / 50 * 1e3 - 100.0, rel=1e-4)


def test_unified_rank_in_a_closed_loop() -> None:
    """One H200, V2-Lite, 1000-token prompts, 128 new tokens: more clients, more throughput
    and longer steps; the decode batch obeys Little's law, b = X · out · step."""
    target = Target(1000, 128, 1e9, 1e9)
    rows = [unified_rank_at(V2_LITE, H200, Parallel(), target, 16384, 256, n) for n in (16, 64)]
    (x16, _, itl16, q16, b16), (x64, ttft64, itl64, q64, b64) = rows
    assert x16 < x64 and itl16[0] <= itl64[0] and q16 == q64 == 0.0
    assert b16 < 16 and b64 < 64
    assert ttft64[0] <= ttft64[1] <= ttft64[2]
    # 512 clients on 256 slots: the capacity binds and the rest queue
    x, ttft, _, queue, b = unified_rank_at(V2_LITE, H200, Parallel(), target, 16384, 256, 512)
    assert queue > 0 and b == pytest.approx(256, rel=0.01)


@pytest.mark.parametrize("clients", [32, 128])
def test_closed_loop_equations_agree_with_the_simulation(clients: int) -> None:
    """Spread lengths (prompts 500-1500, outputs 32-224 tokens) let the clients drift apart:
    the steady-state equations' throughput is within 5% of the step-level simulation of the
    same closed loop (dsmesh/plan/simulate.py, 12 requests a client), and at 32 clients the
    ITL p50 and p90 within 10%."""
    sim = Simulator(V2_LITE, H200, "unified", Parallel(), Parallel())
    res = sim.run(Workload((500, 1500), (32, 224), 12 * clients, concurrency=clients))
    target = Target(1000, 128, 1e9, 1e9)
    x, _, itl, _, _ = unified_rank_at(V2_LITE, H200, Parallel(), target, 16384, 256, clients)
    assert x * 128 == pytest.approx(res.output_tok_s, rel=0.05)
    if clients == 32:
        assert itl[0] == pytest.approx(res.pct("itl_ms", 50), rel=0.10)
        assert itl[1] == pytest.approx(res.pct("itl_ms", 90), rel=0.10)


def test_fixed_lengths_keep_the_clients_in_cohorts() -> None:
    """bench's fixed output length: a wave of 64 prompts is prefilled in 4 steps of 16,384
    tokens, then decodes 127 steps together; its TTFTs are 1-4 such steps."""
    target = Target(1000, 128, 1e9, 1e9, fixed_output=True)
    x, ttft, itl, queue, b = unified_rank_at(V2_LITE, H200, Parallel(), target, 16384, 256, 64)
    assert b == 64 and queue == 0.0
    assert ttft[0] * 2 == pytest.approx(ttft[1])  # p50 after 2 of 4 steps, p90 after 4
    cycle = 64 / x * 1e3
    assert cycle == pytest.approx(ttft[1] + 127 * itl[0], rel=1e-6)  # 4 steps, then 127
