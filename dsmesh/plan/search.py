"""``dsmesh plan``'s search: every deployment of a GPU count (unified or PD, prefill:decode
split, EP sizes, redundant experts, chunk and batch sizes, TBO, MTP) scored in steady state
against the latency targets; the best by output tokens/s per GPU.

The steady state is analytic (docs/PLAN.md, "Serving equations"): a decode rank runs the
largest batch whose step meets the ITL target and fits its KV pool; a prefill rank is an
M/D/1 queue whose utilisation the TTFT target caps; the split balances their request rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from dsmesh.plan.balance import synthetic_balancedness
from dsmesh.plan.costs import Parallel, decode_step, kv_capacity_tokens, prefill_step
from dsmesh.plan.hardware import (
    GPU,
    HANDOFF_CONTROL_MS,
    MOONCAKE_NVLINK_INTRA,
    MOONCAKE_RDMA_PER_GPU,
)
from dsmesh.plan.queueing import md1_wait_quantile, mixture_quantile
from dsmesh.plan.shapes import ModelShape

MAX_UTILISATION = 0.9
BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
CHUNKS = (2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class Target:
    """The workload in steady state and its latency targets (p90, milliseconds)."""

    input_len: float
    output_len: float
    ttft_p90_ms: float
    itl_p90_ms: float
    mtp_acceptance: float = 0.0  # per draft; 0: MTP off
    # every request generates the same number of tokens: a closed loop's clients then move
    # in cohorts (dsmesh/plan/closed_loop.py); spread lengths let them drift apart
    fixed_output: bool = False


@dataclass(frozen=True)
class Plan:
    """One scored deployment. Rates are per GPU of the whole deployment."""

    mode: str  # "pd" | "unified"
    prefill_instances: int
    prefill_ep: int
    decode_instances: int  # unified: the unified instances
    decode_ep: int
    prefill_redundant: int
    decode_redundant: int
    prefill_tbo: bool
    decode_tbo: bool
    chunk: int
    batch: int  # running requests per decode (or unified) GPU
    mtp: bool
    out_tok_s_gpu: float
    in_tok_s_gpu: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    kv_tokens_gpu: int
    binding: str
    output_len: float

    @property
    def rate(self) -> float:
        """Requests per second the whole deployment serves within the targets."""
        return self.out_tok_s_gpu * self.gpus / self.output_len

    @property
    def gpus(self) -> int:
        return self.prefill_instances * self.prefill_ep + self.decode_instances * self.decode_ep

    def layout(self) -> str:
        """``P 2 x EP16+32 : D 1 x EP56+24``: instances x EP size + redundant experts."""

        def group(n: int, ep: int, red: int) -> str:
            return f"{n} x EP{ep}" + (f"+{red}" if red else "")

        if self.mode == "unified":
            return "unified " + group(self.decode_instances, self.decode_ep, self.decode_redundant)
        return (
            f"P {group(self.prefill_instances, self.prefill_ep, self.prefill_redundant)} : "
            f"D {group(self.decode_instances, self.decode_ep, self.decode_redundant)}"
        )


Balance = Callable[[int, int, int], float]  # (experts, ep, redundant) -> balancedness


@lru_cache(maxsize=4096)
def synthetic_balance(experts: int, ep: int, redundant: int) -> float:
    """EPLB's placement of the synthetic load (dsmesh.plan.balance)."""
    return synthetic_balancedness(experts, ep, redundant, eplb=True)


def ep_choices(shape: ModelShape, gpu: GPU, gpus: int) -> list[tuple[int, int]]:
    """(EP size, redundant experts) pairs an instance of at most ``gpus`` GPUs can take:
    powers of two and whole nodes; redundancy 0 where the experts divide, else the fewest
    slots that make them divide, and 32 (the seed's) where it divides."""
    sizes = {1 << i for i in range(12) if 1 << i <= gpus}
    sizes |= {gpu.gpus_per_node * k for k in range(1, gpus // gpu.gpus_per_node + 1)}
    out = []
    for ep in sorted(sizes):
        if ep == 1:
            out.append((1, 0))
            continue
        fill = (-shape.num_experts) % ep
        for redundant in sorted({fill, fill + ep * math.ceil(max(0, 32 - fill) / ep)}):
            if redundant <= shape.num_experts:
                out.append((ep, redundant))
    return out


def _par(shape: ModelShape, ep: int, redundant: int, tbo: bool, balance: Balance) -> Parallel:
    return Parallel(ep, redundant, balance(shape.num_experts, ep, redundant), tbo)


def _mtp_tokens(acceptance: float) -> float:
    return 1.0 + acceptance


def decode_rank(
    shape: ModelShape, gpu: GPU, par: Parallel, target: Target, mtp: bool, max_batch: int
):
    """(batch, requests/s, ITL ms, KV tokens, binding) of the best decode rank, or None."""
    kv = kv_capacity_tokens(shape, gpu, par)
    if kv <= 0:
        return None
    fit = int(kv // (target.input_len + target.output_len))
    best = None
    for b in BATCHES:
        if b > max_batch:
            break
        if b > fit:
            return best and (*best[:4], "KV capacity")
        step = decode_step_ms(shape, gpu, par, target, mtp, b)
        tokens = _mtp_tokens(target.mtp_acceptance) if mtp else 1.0
        itl = step / tokens
        if step > target.itl_p90_ms:  # a step with no accepted draft is one token a step
            return best and (*best[:4], "ITL p90")
        best = (b, b * tokens / (step / 1e3) / target.output_len, itl, kv, "max batch")
    return best


def decode_step_ms(
    shape: ModelShape, gpu: GPU, par: Parallel, target: Target, mtp: bool, b: float
) -> float:
    """A decode rank's step at batch ``b`` with its serving cost; with MTP a step verifies
    two rows per sequence and runs the draft, one more layer."""
    context = target.input_len + target.output_len / 2
    step = decode_step(shape, gpu, par, b, context, 2.0 if mtp else 1.0).total_ms
    step += gpu.kernels.host_ms_per_request * b
    if mtp:
        step *= 1.0 + 1.0 / shape.num_layers
    return step


def prefill_rank(
    shape: ModelShape, gpu: GPU, par: Parallel, target: Target, chunk: int, budget_ms: float
):
    """(requests/s, TTFT p50, p90, p99, binding, service ms, forward ms) of a prefill rank
    whose TTFT p90 stays within ``budget_ms`` (the target less the handoff and the first
    decode step), or None. ``service`` is a prompt's share of the forwards, ``forward`` one
    forward of ``chunk`` tokens."""
    service, forward, latency = prefill_costs(shape, gpu, par, target, chunk)
    if latency > budget_ms:
        return None
    # the largest utilisation whose M/D/1 wait (service: one forward) keeps p90 in budget
    room = budget_ms - latency
    lo, hi = 0.0, MAX_UTILISATION
    if md1_wait_quantile(hi, forward, 0.9) <= room:
        lo = hi
    else:
        for _ in range(50):
            mid = (lo + hi) / 2
            if md1_wait_quantile(mid, forward, 0.9) <= room:
                lo = mid
            else:
                hi = mid
    rho = lo
    if rho <= 0:
        return None
    binding = "TTFT p90" if rho < MAX_UTILISATION else "prefill capacity"
    rate = rho / (service / 1e3)
    t50, t90, t99 = (latency + md1_wait_quantile(rho, forward, q) for q in (0.5, 0.9, 0.99))
    return rate, t50, t90, t99, binding, service, forward


def prefill_costs(
    shape: ModelShape, gpu: GPU, par: Parallel, target: Target, chunk: int
) -> tuple[float, float, float]:
    """(service, forward, latency) ms of a prefill rank in chunks of ``chunk`` tokens: a
    prompt's share of the forwards, one forward, and a prompt's own forwards end to end."""
    per_step = min(chunk, target.input_len)
    steps = math.ceil(target.input_len / chunk)
    service = (
        sum(
            prefill_step(shape, gpu, par, chunk, per_step, cached=i * chunk).total_ms
            for i in range(steps)
        )
        * per_step
        / chunk
    )
    forward = prefill_step(shape, gpu, par, chunk, per_step).total_ms
    return service, forward, steps * forward


def _handoff_ms(shape: ModelShape, target: Target, gpu: GPU, total: int) -> float:
    rate = MOONCAKE_NVLINK_INTRA if total <= gpu.gpus_per_node else MOONCAKE_RDMA_PER_GPU
    return target.input_len * shape.kv_bytes_per_token / rate * 1e3 + HANDOFF_CONTROL_MS


def search(
    shape: ModelShape, gpu: GPU, gpus: int, target: Target,
    modes: tuple[str, ...] = ("pd", "unified"),
    max_batch: int = 512, balance: Balance = synthetic_balance, max_unified_ep: int = 1,
) -> list[Plan]:  # fmt: skip
    """Every deployment of at most ``gpus`` GPUs that meets the targets, the most requests
    per second first.
    Unified instances stay at EP ``max_unified_ep`` (``dsmesh up`` runs them as one process)."""
    plans: list[Plan] = []
    mtps = (False, True) if target.mtp_acceptance > 0 and shape.mtp_layers else (False,)
    choices = ep_choices(shape, gpu, gpus)
    if "unified" in modes:
        unified = [(ep, red) for ep, red in choices if ep <= max_unified_ep]
        plans += _unified(shape, gpu, gpus, target, unified, max_batch, balance)
    if "pd" in modes and gpus >= 2:
        plans += _pd(shape, gpu, gpus, target, choices, mtps, max_batch, balance)
    # the most output from the GPUs given; among equals, the fewest GPUs
    plans.sort(key=lambda p: (-round(p.rate, 6), p.gpus, -p.out_tok_s_gpu))
    return plans


def _pd(shape, gpu, gpus, target, choices, mtps, max_batch, balance) -> list[Plan]:
    out = []
    handoff = _handoff_ms(shape, target, gpu, gpus)
    decodes = [
        (ep, red, par.tbo, mtp, d)
        for ep, red, par, mtp, d in decode_candidates(
            shape, gpu, target, choices, mtps, max_batch, balance
        )
    ]
    prefills = []
    for ep, red in choices:
        for tbo in (False, True):
            par = _par(shape, ep, red, tbo, balance)
            for chunk in CHUNKS:
                if kv_capacity_tokens(shape, gpu, par) < chunk:
                    continue  # the weights leave no room for the chunk's KV
                # the TTFT left once the KV is handed off and decode has stepped once
                budget = target.ttft_p90_ms - handoff - target.itl_p90_ms
                p = prefill_rank(shape, gpu, par, target, chunk, budget)
                if p:
                    prefills.append((ep, red, tbo, chunk, p))
    # the best two of each side per EP size, then every split of the GPUs between them
    decodes = _best_per_ep(decodes, lambda d: d[4][1])
    prefills = _best_per_ep(prefills, lambda p: p[4][0])
    for dep, dred, dtbo, mtp, (b, d_rate, itl, kv, d_bind) in decodes:
        for pep, pred, ptbo, chunk, (p_rate, t50, t90, t99, p_bind, *_) in prefills:
            for np_ in range(1, gpus // pep + 1):
                nd = (gpus - np_ * pep) // dep
                if nd < 1:
                    break
                rate_p, rate_d = np_ * pep * p_rate, nd * dep * d_rate
                rate = min(rate_p, rate_d)
                used = np_ * pep + nd * dep
                bind = f"prefill: {p_bind}" if rate_p < rate_d else f"decode: {d_bind}"
                step = itl * (_mtp_tokens(target.mtp_acceptance) if mtp else 1.0)
                if t90 + handoff + step > target.ttft_p90_ms:
                    continue
                out.append(Plan(
                    "pd", np_, pep, nd, dep, pred, dred, ptbo, dtbo, chunk, b, mtp,
                    rate * target.output_len / used, rate * target.input_len / used,
                    t50 + handoff + step, t90 + handoff + step, t99 + handoff + step,
                    itl, step, step, kv, bind, target.output_len,
                ))  # fmt: skip
    return out


def decode_candidates(
    shape: ModelShape, gpu, target: Target, choices, mtps, max_batch: int, balance: Balance
) -> list[tuple]:
    """Every decode rank that meets the targets: ``(ep, redundant, parallel, mtp, figures)``
    for each EP choice, TBO off and on, and MTP off and on."""
    out = []
    for ep, red in choices:
        for tbo in (False, True):
            par = _par(shape, ep, red, tbo, balance)
            for mtp in mtps:
                d = decode_rank(shape, gpu, par, target, mtp, max_batch)
                if d:
                    out.append((ep, red, par, mtp, d))
    return out


def _best_per_ep(items: list, score: Callable) -> list:
    out: dict[int, list] = {}
    for item in sorted(items, key=lambda x: -score(x)):
        out.setdefault(item[0], [])
        if len(out[item[0]]) < 2:
            out[item[0]].append(item)
    return [x for group in out.values() for x in group]


def _unified(shape, gpu, gpus, target, choices, max_batch, balance) -> list[Plan]:
    """Chunked prefill in the decode steps: a rank at batch b has a chunk in a share
    q = b · in / (out · chunk) of its steps, a step carrying a chunk on any rank takes
    t_d + t_chunk, and prompts queue for the chunk budget as for a prefill rank. Per EP
    layout, TBO and chunk the largest batch that meets the targets; the binding constraint
    is what stopped the next batch size."""
    out = []
    for ep, red in choices:
        if gpus % ep:
            continue
        for tbo in (False, True):
            par = _par(shape, ep, red, tbo, balance)
            kv = kv_capacity_tokens(shape, gpu, par)
            if kv <= 0:
                continue
            fit = int(kv // (target.input_len + target.output_len))
            for chunk in CHUNKS:
                best, bind = None, "max batch"
                for b in BATCHES:
                    if b > max_batch:
                        break
                    if b > fit:
                        bind = "KV capacity"
                        break
                    row, why = _unified_rank(shape, gpu, par, target, chunk, b)
                    if why:
                        bind = why
                        break
                    best = row
                if best:
                    r, t50, t90, t99, i50, i90, i99, b = best
                    out.append(Plan(
                        "unified", 0, 0, gpus // ep, ep, 0, red, tbo, tbo, chunk, b, False,
                        r * target.output_len, r * target.input_len, t50, t90, t99, i50, i90, i99,
                        kv, bind, target.output_len,
                    ))  # fmt: skip
    return out


def _unified_rank(shape, gpu, par, target, chunk, b):
    """((requests/s, TTFT p50, p90, p99, ITL p50, p90, p99, batch), None) or (None, the
    target missed)."""
    u = unified_costs(shape, gpu, par, target, chunk, b)
    if u is None:
        return None, "TTFT p90"
    lat = unified_latency(target, chunk, par.ep, u)
    if lat.itl[1] > target.itl_p90_ms:
        return None, "ITL p90"
    if lat.ttft[1] > target.ttft_p90_ms:
        return None, "TTFT p90"
    r = b / (target.output_len * lat.step) * 1e3
    return (r, *lat.ttft, *lat.itl, b), None


@dataclass(frozen=True)
class UnifiedCosts:
    """A unified rank at batch ``b``: its decode step, the prompt forward a step carries,
    the share of its steps that carry one, and the chunk budget's utilisation."""

    t_d: float  # ms
    t_prefill: float  # ms
    p_rank: float
    q: float


def unified_costs(shape, gpu, par, target, chunk, b) -> UnifiedCosts | None:
    """Each step ends b / out requests on average, so m = b / out prompts arrive per step.
    A rank's step carries prompt tokens when one arrived during the last (1 - e^(-m)) or
    when its backlog needs the steps (m·in / chunk), whichever is more; such a step carries
    the step's arrivals, at most a chunk. None when the chunks cannot keep up."""
    context = target.input_len + target.output_len / 2
    m = b / target.output_len
    q = m * target.input_len / chunk
    if q >= MAX_UTILISATION:
        return None
    p_rank = min(1.0, max(-math.expm1(-m), q))
    tokens = min(float(chunk), target.input_len * m / p_rank)
    t_prefill = prefill_step(shape, gpu, par, tokens, min(tokens, target.input_len)).total_ms
    t_d = decode_step(shape, gpu, par, b, context).total_ms + gpu.kernels.host_ms_per_request * b
    return UnifiedCosts(t_d, t_prefill, p_rank, q)


@dataclass(frozen=True)
class UnifiedLatency:
    step: float  # the mean step, ms
    ttft: tuple[float, float, float]  # p50, p90, p99
    itl: tuple[float, float, float]


def unified_latency(target: Target, chunk: int, ep: int, u: UnifiedCosts) -> UnifiedLatency:
    """A step takes t_d + t_prefill when any of the ``ep`` ranks carries prompt tokens (the
    all-to-all keeps them in lockstep: p = 1 - (1 - p_rank)^ep), else t_d; the ITL's
    quantiles are this mixture's. A prompt waits for the chunk budget as in an M/D/1 queue
    of steps at utilisation q, then runs its own chunks, each a step with prompt tokens."""
    p = 1.0 - (1.0 - u.p_rank) ** ep
    step = u.t_d + p * u.t_prefill
    mix = [(u.t_d, 1.0 - p), (u.t_d + u.t_prefill, p)]
    itl = tuple(mixture_quantile(mix, x) for x in (0.5, 0.9, 0.99))
    own = math.ceil(target.input_len / chunk) * (u.t_prefill + u.t_d)
    ttft = tuple(own + md1_wait_quantile(u.q, step, x) for x in (0.5, 0.9, 0.99))
    return UnifiedLatency(step, ttft, itl)  # type: ignore[arg-type]
