"""``dsmesh plan --concurrency N``: deployments scored at a fixed number of clients, each
sending its next request when the last one ends (what ``dsmesh bench --concurrency`` runs).

The throughput X and the latencies solve Little's law together: X = N / R(X), where the
response time R grows with X through the prefill queue, the decode batch and the steps'
prompt share (docs/PLAN.md, "A closed loop"). Step times are taken on the batch sizes of
:data:`dsmesh.plan.search.BATCHES` and interpolated between them.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from dsmesh.plan.costs import decode_step, kv_capacity_tokens, prefill_step
from dsmesh.plan.queueing import (
    closed_loop_rate,
    md1_mean_wait,
    md1_wait_quantile,
    mixture_quantile,
)
from dsmesh.plan.search import (
    BATCHES,
    CHUNKS,
    Balance,
    Plan,
    Target,
    UnifiedCosts,
    _best_per_ep,
    _handoff_ms,
    _par,
    decode_candidates,
    decode_step_ms,
    ep_choices,
    prefill_costs,
    synthetic_balance,
    unified_costs,
    unified_latency,
)
from dsmesh.plan.shapes import ModelShape


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def _grid(cap: int) -> list[int]:
    return sorted({b for b in BATCHES if b < cap} | {cap})


def _solve_batch(rate_at: float, step, cap: float) -> float:
    """The batch b with b = rate_at · step(b) (Little's law for the running requests), b in
    [0, cap]; ``rate_at`` is requests/ms that enter the batch."""
    lo, hi = 0.0, float(cap)
    if hi - rate_at * step(hi) <= 0:
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if mid - rate_at * step(mid) < 0:
            lo = mid
        else:
            hi = mid
    return hi


def search_concurrency(
    shape: ModelShape, gpu, gpus: int, target: Target, concurrency: int,
    modes: tuple[str, ...] = ("pd", "unified"), max_batch: int = 512,
    balance: Balance = synthetic_balance, max_unified_ep: int = 1,
) -> list[Plan]:  # fmt: skip
    """Every deployment of at most ``gpus`` GPUs that meets the targets with
    ``concurrency`` clients, the most requests per second first."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1 (got {concurrency})")
    plans: list[Plan] = []
    choices = ep_choices(shape, gpu, gpus)
    if "unified" in modes:
        unified = [(ep, red) for ep, red in choices if ep <= max_unified_ep and not gpus % ep]
        for ep, red in unified:
            for tbo in (False, True):
                par = _par(shape, ep, red, tbo, balance)
                plans += _unified(shape, gpu, gpus, target, concurrency, par, red, max_batch)
    if "pd" in modes and gpus >= 2:
        mtps = (False, True) if target.mtp_acceptance > 0 and shape.mtp_layers else (False,)
        plans += _pd(shape, gpu, gpus, target, concurrency, choices, mtps, max_batch, balance)
    plans.sort(key=lambda p: (-round(p.rate, 6), p.gpus, -p.out_tok_s_gpu))
    return plans


def unified_rank_at(shape, gpu, par, target: Target, chunk: int, cap: int, clients: float):
    """(requests/s, TTFT p50/p90/p99, ITL p50/p90/p99, queue wait ms, batch) of one
    unified rank with ``clients`` clients and at most ``cap`` running, or None."""
    if target.fixed_output:
        return _unified_cohort(shape, gpu, par, target, chunk, cap, clients)
    grid, costs = [], []
    for b in _grid(cap):
        u = unified_costs(shape, gpu, par, target, chunk, b)
        if u is None:
            break
        grid.append(float(b))
        costs.append(u)
    if not grid:
        return None
    cap_b = grid[-1]
    own_steps = math.ceil(target.input_len / chunk)

    def at(b: float) -> UnifiedCosts:
        fields = ("t_d", "t_prefill", "p_rank", "q")
        vals = [_interp(grid, [getattr(c, f) for c in costs], b) for f in fields]
        return UnifiedCosts(*vals)

    def step(b: float) -> float:
        u = at(b)
        return u.t_d + (1.0 - (1.0 - u.p_rank) ** par.ep) * u.t_prefill

    def batch(x: float) -> float:  # x requests/s: each decodes for out steps
        return _solve_batch(x / 1e3 * target.output_len, step, cap_b)

    def response(x: float) -> float:
        b = batch(x)
        u, t = at(b), step(b)
        ttft = own_steps * (u.t_prefill + u.t_d) + md1_mean_wait(u.q, t)
        return ttft + (target.output_len - 1) * t

    capacity = cap_b / (target.output_len * step(cap_b)) * 1e3
    x, queue = closed_loop_rate(clients, response, capacity)
    b = batch(x)
    lat = unified_latency(target, chunk, par.ep, at(b))
    ttft = tuple(v + queue for v in lat.ttft)
    return x, ttft, lat.itl, queue, b


def _cohort_quantiles(steps: int, step_ms: float, extra_ms: float) -> tuple[float, ...]:
    """TTFT quantiles of a cohort whose prompts finish over ``steps`` equal steps (the i-th
    step's prompts at i·step), plus ``extra_ms``."""
    return tuple(math.ceil(q * steps) * step_ms + extra_ms for q in (0.5, 0.9, 0.99))


def _unified_cohort(shape, gpu, par, target: Target, chunk: int, cap: int, clients: float):
    """Clients in cohorts: a wave of n = min(clients, cap) prompts is prefilled in
    k = ceil(n·in / chunk) steps that also decode the wave's earlier prompts, then the wave
    decodes out - 1 steps together, and its clients' next prompts arrive together:
    R = k·(t_prefill + t_d) + (out - 1)·t_d, X = n / R."""
    n = min(float(clients), float(cap))
    tokens = n * target.input_len
    k = max(1, math.ceil(tokens / chunk))
    per_step = min(float(chunk), tokens)
    context = target.input_len + target.output_len / 2
    t_pf = prefill_step(shape, gpu, par, per_step, min(per_step, target.input_len)).total_ms
    t_d = decode_step(shape, gpu, par, n, context).total_ms + gpu.kernels.host_ms_per_request * n
    cycle = k * (t_pf + t_d) + (target.output_len - 1) * t_d
    x = n / cycle * 1e3
    queue = max(0.0, clients / x * 1e3 - cycle) if clients > n else 0.0
    ttft = _cohort_quantiles(k, t_pf + t_d, queue)
    # a prompt done at step i decodes beside the wave's later chunks: (k - 1) / 2 of its
    # out - 1 gaps carry a chunk on average
    share = (k - 1) / (2.0 * max(1.0, target.output_len - 1))
    mix = [(t_d, 1.0 - share), (t_d + t_pf, share)]
    itl = tuple(mixture_quantile(mix, q) for q in (0.5, 0.9, 0.99))
    return x, ttft, itl, queue, n


def _unified(shape, gpu, gpus, target, concurrency, par, red, max_batch) -> list[Plan]:
    kv = kv_capacity_tokens(shape, gpu, par)
    fit = int(kv // (target.input_len + target.output_len))
    if fit < 1:
        return []
    ranks = gpus  # DP attention: every GPU holds its own requests
    clients = concurrency / ranks
    out = []
    for chunk in CHUNKS:
        best = None
        for cap in sorted({b for b in BATCHES if b <= min(max_batch, fit)}, reverse=True):
            r = unified_rank_at(shape, gpu, par, target, chunk, cap, clients)
            if r is None:
                continue
            x, ttft, itl, queue, b = r
            if itl[1] > target.itl_p90_ms or ttft[1] > target.ttft_p90_ms:
                continue
            if best is None or x > best[0] * (1 + 1e-9):
                best = (x, ttft, itl, queue, cap)
        if best:
            x, ttft, itl, queue, cap = best
            bind = _unified_binding(queue, cap, fit, max_batch, concurrency)
            out.append(Plan(
                "unified", 0, 0, gpus // par.ep, par.ep, 0, red, par.tbo, par.tbo, chunk, cap,
                False, x * target.output_len, x * target.input_len, *ttft, *itl, kv, bind,
                target.output_len,
            ))  # fmt: skip
    return out


def _unified_binding(queue: float, cap: int, fit: int, max_batch: int, clients: int) -> str:
    if queue <= 0:
        return f"concurrency {clients}"
    if cap >= fit:
        return "KV capacity"
    return "max batch" if cap >= max_batch else "ITL p90"


def pd_at(shape, gpu, target, concurrency, prefill, decode, handoff):
    """(requests/s, TTFT p50/p90/p99, ITL p50/p90/p99, binding) of a PD deployment with
    ``concurrency`` clients: ``prefill`` (GPUs, service ms, forward ms, latency ms,
    parallel, chunk) and
    ``decode`` (GPUs, parallel, MTP, cap batch, cap binding)."""
    p_gpus, service, forward, latency, ppar, chunk = prefill
    d_gpus, par, mtp, cap, d_bind = decode
    tokens = 1.0 + target.mtp_acceptance if mtp else 1.0
    if target.fixed_output:
        return _pd_cohort(shape, gpu, target, concurrency, prefill, decode, handoff)
    grid = [float(b) for b in _grid(cap)]
    steps = [decode_step_ms(shape, gpu, par, target, mtp, b) for b in grid]

    def step(b: float) -> float:
        return _interp(grid, steps, b)

    def batch(x: float) -> float:
        per_gpu = x / 1e3 / d_gpus * (target.output_len - 1) / tokens
        return _solve_batch(per_gpu, step, cap)

    def rho(x: float) -> float:
        return x * service / 1e3 / p_gpus

    def response(x: float) -> float:
        t = step(batch(x))
        first = latency + md1_mean_wait(rho(x), forward) + handoff + t
        return first + (target.output_len - 1) / tokens * t

    p_cap = p_gpus * 1e3 / service
    d_cap = d_gpus * cap * tokens * 1e3 / ((target.output_len - 1) * step(cap))
    x, queue = closed_loop_rate(concurrency, response, min(p_cap, d_cap))
    t = step(batch(x))
    most = concurrency * service / p_gpus  # the closed loop's queue holds the others at most
    ttft = tuple(
        latency + min(most, md1_wait_quantile(rho(x), forward, q)) + handoff + t + queue
        for q in (0.5, 0.9, 0.99)
    )
    itl = (t / tokens, t, t)
    if queue <= 0:
        bind = f"concurrency {concurrency}"
    else:
        bind = "prefill: prefill capacity" if p_cap < d_cap else f"decode: {d_bind}"
    return x, ttft, itl, bind


def _pd_cohort(shape, gpu, target, concurrency, prefill, decode, handoff):
    """Clients in cohorts: a wave of n = min(clients, decode GPUs x cap) prompts is
    prefilled in f = ceil(n·in / (P·chunk)) forwards per prefill GPU, handed off, and
    decoded together: R = f·t_f + handoff + (1 + (out - 1) / tokens)·step, X = n / R."""
    p_gpus, _, _, _, ppar, chunk = prefill
    d_gpus, par, mtp, cap, d_bind = decode
    tokens = 1.0 + target.mtp_acceptance if mtp else 1.0
    n = min(float(concurrency), float(d_gpus * cap))
    per_gpu = n * target.input_len / p_gpus
    f = max(1, math.ceil(per_gpu / chunk))
    size = min(float(chunk), per_gpu)
    t_f = prefill_step(shape, gpu, ppar, size, min(size, target.input_len)).total_ms
    step = decode_step_ms(shape, gpu, par, target, mtp, n / d_gpus)
    cycle = f * t_f + handoff + (1.0 + (target.output_len - 1) / tokens) * step
    x = n / cycle * 1e3
    queue = max(0.0, concurrency / x * 1e3 - cycle) if concurrency > n else 0.0
    ttft = _cohort_quantiles(f, t_f, handoff + step + queue)
    bind = f"decode: {d_bind}" if queue > 0 else f"concurrency {concurrency}"
    return x, ttft, (step / tokens, step, step), bind


def _pd(shape, gpu, gpus, target, concurrency, choices, mtps, max_batch, balance) -> list[Plan]:
    handoff = _handoff_ms(shape, target, gpu, gpus)
    decodes = decode_candidates(shape, gpu, target, choices, mtps, max_batch, balance)
    prefills = []
    for ep, red in choices:
        for tbo in (False, True):
            par = _par(shape, ep, red, tbo, balance)
            for chunk in CHUNKS:
                if kv_capacity_tokens(shape, gpu, par) < chunk:
                    continue
                service, forward, latency = prefill_costs(shape, gpu, par, target, chunk)
                if latency + handoff > target.ttft_p90_ms:
                    continue
                prefills.append((ep, red, par, chunk, (service, forward, latency)))
    decodes = _best_per_ep(decodes, lambda d: d[4][1])
    # per EP size and chunk: a larger chunk serves more but makes each prompt wait longer
    prefills = [
        p
        for chunk in CHUNKS
        for p in _best_per_ep([p for p in prefills if p[3] == chunk], lambda p: -p[4][0])
    ]
    out = []
    for dep, dred, dpar, mtp, (cap, _, _, kv, d_bind) in decodes:
        for pep, pred, ppar, chunk, (service, forward, latency) in prefills:
            for np_ in range(1, gpus // pep + 1):
                nd = (gpus - np_ * pep) // dep
                if nd < 1:
                    break
                p_gpus, d_gpus = np_ * pep, nd * dep
                x, ttft, itl, bind = pd_at(
                    shape, gpu, target, concurrency,
                    (p_gpus, service, forward, latency, ppar, chunk),
                    (d_gpus, dpar, mtp, cap, d_bind), handoff,
                )  # fmt: skip
                if ttft[1] > target.ttft_p90_ms or itl[1] > target.itl_p90_ms:
                    continue
                used = p_gpus + d_gpus
                out.append(Plan(
                    "pd", np_, pep, nd, dep, pred, dred, ppar.tbo, dpar.tbo, chunk, cap, mtp,
                    x * target.output_len / used, x * target.input_len / used, *ttft, *itl,
                    kv, bind, target.output_len,
                ))  # fmt: skip
    return out
