"""A step-level simulation of one rank's engines serving a workload: continuous batching,
chunked prefill, the PD handoff, KV admission and retraction, prefill and decode sharing a
GPU, queueing from a closed loop or Poisson arrivals.

The step times come from :mod:`dsmesh.plan.costs`; nothing runs on a GPU. An EP instance is
simulated as one of its ranks (DP attention: each rank has its own requests) with the
instance's placement and all-to-all in its step times; the ranks' lockstep is not.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from dsmesh.plan.costs import Parallel, decode_step, kv_capacity_tokens, prefill_step
from dsmesh.plan.hardware import GPU, HANDOFF_CONTROL_MS, MOONCAKE_NVLINK_INTRA
from dsmesh.plan.shapes import ModelShape

MPS_SHARE = 0.56  # each of two processes' share of a GPU under MPS (the probe: 0.69 + 0.43)


@dataclass(frozen=True)
class Workload:
    """Requests: prompt and output lengths drawn uniformly from [lo, hi]; a closed loop of
    ``concurrency`` clients, or Poisson arrivals at ``rate`` requests/s (one of the two)."""

    input_len: tuple[int, int] = (1000, 1000)
    output_len: tuple[int, int] = (128, 128)
    num_requests: int = 256
    concurrency: int = 0
    rate: float = 0.0
    seed: int = 1

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if lo < 1 or hi < lo:
                raise ValueError(f"{name}: need 1 <= lo <= hi (got {lo}, {hi})")
        if (self.concurrency > 0) == (self.rate > 0):
            raise ValueError("workload: give concurrency or rate, exactly one of them")

    @property
    def mean_input(self) -> float:
        return sum(self.input_len) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output_len) / 2


@dataclass(frozen=True)
class EngineSetup:
    """One rank's engine options, as ``dsmesh up`` passes them."""

    max_running: int = 256
    max_batch_tokens: int = 16384
    kv_tokens: int = 0  # 0: from the GPU's memory (kv_capacity_tokens)
    mem_fraction: float = 0.85


@dataclass
class _Req:
    arrival: float
    input_len: int
    output_len: int
    prefilled: int = 0
    generated: int = 0
    first_token: float = -1.0
    output_total: int = 0  # tokens to emit in all
    prompt_len: int = 0  # as sent (input_len grows when a retraction recomputes)
    token_times: list[float] = field(default_factory=list)
    done: float = -1.0


@dataclass
class SimResult:
    output_tok_s: float
    input_tok_s: float
    ttft_ms: list[float]
    itl_ms: list[float]
    duration_s: float
    retractions: int
    peak_kv_tokens: int
    kv_capacity: int

    def pct(self, name: str, q: float) -> float:
        return percentile(getattr(self, name), q)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _pairs(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:], strict=False))


def _requests(w: Workload) -> list[_Req]:
    rng = random.Random(w.seed)
    t = 0.0
    out = []
    for _ in range(w.num_requests):
        if w.rate > 0:
            t += rng.expovariate(w.rate)
        n_out = rng.randint(*w.output_len)
        n_in = rng.randint(*w.input_len)
        out.append(_Req(t, n_in, n_out, output_total=n_out, prompt_len=n_in))
    return out


class _Engine:
    """One engine process: a waiting queue, running requests, its KV pool."""

    def __init__(self, kv_capacity: int, setup: EngineSetup) -> None:
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.free_at = 0.0
        self.kv_capacity = kv_capacity
        self.setup = setup
        self.retractions = 0
        self.peak_kv = 0

    def kv_used(self) -> int:
        return sum(r.prefilled + r.generated for r in self.running)

    def admit(self, handed_off: bool) -> None:
        """Waiting requests join while slots and pages allow: a handed-off request's prompt,
        or a new one's prompt and its first token."""
        while self.waiting and len(self.running) < self.setup.max_running:
            needs = self.waiting[0].input_len + (0 if handed_off else 1)
            if self.kv_used() + needs > self.kv_capacity:
                break
            self.running.append(self.waiting.popleft())

    def retract_for_growth(self) -> None:
        """Each decoding request takes one more token's page room this step; when the pool
        cannot hold them, the newest requests go back to the queue and recompute later."""
        while self.running and self.kv_used() + len(self.running) > self.kv_capacity:
            victim = self.running.pop()
            victim.input_len += victim.generated  # recomputed as prompt
            victim.prefilled = victim.generated = 0
            self.waiting.appendleft(victim)
            self.retractions += 1
        self.peak_kv = max(self.peak_kv, self.kv_used())


class Simulator:
    """``kind`` ``unified`` (one engine) or ``pd`` (a prefill and a decode engine, on one
    GPU under MPS when ``shared_gpu``, else each on its own)."""

    def __init__(
        self, shape: ModelShape, gpu: GPU, kind: str, prefill_par: Parallel, decode_par: Parallel,
        setup: EngineSetup = EngineSetup(), shared_gpu: bool = False,
        kv_rate_bytes_s: float = MOONCAKE_NVLINK_INTRA,
    ) -> None:  # fmt: skip
        if kind not in ("unified", "pd"):
            raise ValueError(f"kind must be 'unified' or 'pd' (got {kind!r})")
        self.shape, self.gpu, self.kind, self.setup = shape, gpu, kind, setup
        self.ppar, self.dpar, self.shared = prefill_par, decode_par, shared_gpu
        self.kv_rate = kv_rate_bytes_s
        share = 0.5 if shared_gpu else 1.0
        frac = setup.mem_fraction * share
        self.capacity = setup.kv_tokens or kv_capacity_tokens(shape, gpu, decode_par, frac)
        self._dcache: dict[tuple[int, int], float] = {}

    def _decode_ms(self, batch: int, context: float) -> float:
        key = (batch, int(context) // 64)
        if key not in self._dcache:
            k = self.gpu.kernels
            step = decode_step(self.shape, self.gpu, self.dpar, batch, context).total_ms
            self._dcache[key] = step + k.host_ms_per_request * batch
        return self._dcache[key]

    def _prefill_ms(self, chunks: list[tuple[int, int]], par: Parallel, eager: bool) -> float:
        tokens = sum(n for n, _ in chunks)
        if not tokens:
            return 0.0
        cached = sum(c * n for n, c in chunks) / tokens
        step = prefill_step(
            self.shape, self.gpu, par, tokens, tokens / len(chunks), cached
        ).total_ms
        if not eager:
            return step
        # an eager forward beside the decode graph: the host launches while the GPU works, so
        # a long prompt hides the launches and a short one waits for them
        return max(step, self.gpu.kernels.eager_layer_ms * self.shape.num_layers)

    def _take_chunks(self, engine: _Engine) -> list[tuple[_Req, int]]:
        budget = self.setup.max_batch_tokens
        out = []
        for r in engine.running:
            left = r.input_len - r.prefilled
            if left > 0 and budget > 0:
                n = min(left, budget)
                out.append((r, n))
                budget -= n
        return out

    def run(self, workload: Workload) -> SimResult:
        reqs = _requests(workload)
        pending = deque(reqs)
        eng = _Engine(self.capacity, self.setup)
        pre_setup = EngineSetup(max_running=1 << 30, max_batch_tokens=self.setup.max_batch_tokens)
        pre = _Engine(1 << 62, pre_setup)
        handoffs: list[tuple[float, _Req]] = []
        clients, issued, done, now = workload.concurrency, 0, 0, 0.0
        while done < len(reqs):
            while pending and (
                (clients and issued - done < clients) or (not clients and pending[0].arrival <= now)
            ):
                r = pending.popleft()
                if clients:
                    r.arrival = now
                (pre if self.kind == "pd" else eng).waiting.append(r)
                issued += 1
            handoffs.sort(key=lambda h: h[0])
            while handoffs and handoffs[0][0] <= now:
                eng.waiting.append(handoffs.pop(0)[1])
            ran = False
            if (pre.waiting or pre.running) and pre.free_at <= now:
                handoffs += self._prefill_engine_step(pre, eng, now)
                ran = True
            if (eng.waiting or eng.running) and eng.free_at <= now:
                done += self._decode_engine_step(eng, pre, now)
                ran = True
            if ran:
                continue
            nxt = [e.free_at for e in (pre, eng) if (e.waiting or e.running) and e.free_at > now]
            nxt += [h[0] for h in handoffs]
            if pending and not clients:
                nxt.append(pending[0].arrival)
            if not nxt:
                raise RuntimeError("simulation stalled: a request fits no engine's KV pool")
            now = min(nxt)
        start_t = min(r.arrival for r in reqs)
        dur = max(max(r.done for r in reqs) - start_t, 1e-9)
        return SimResult(
            output_tok_s=sum(len(r.token_times) for r in reqs) / dur,
            input_tok_s=sum(r.prompt_len for r in reqs) / dur,
            ttft_ms=[1e3 * (r.first_token - r.arrival) for r in reqs],
            itl_ms=[1e3 * (b - a) for r in reqs for a, b in _pairs(r.token_times)],
            duration_s=dur, retractions=eng.retractions, peak_kv_tokens=eng.peak_kv,
            kv_capacity=self.capacity,
        )  # fmt: skip

    def _prefill_engine_step(
        self, pre: _Engine, dec: _Engine, now: float
    ) -> list[tuple[float, _Req]]:
        """One prefill forward; the finished prompts' KV leaves for decode."""
        pre.admit(True)
        chunks = self._take_chunks(pre)
        ms = self._prefill_ms([(n, r.prefilled) for r, n in chunks], self.ppar, eager=False)
        if self.shared and dec.running:
            ms /= MPS_SHARE
        end = now + ms / 1e3
        out = []
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.input_len:
                pre.running.remove(r)
                kv = r.input_len * self.shape.kv_bytes_per_token
                out.append((end + kv / self.kv_rate + HANDOFF_CONTROL_MS / 1e3, r))
        pre.free_at = end
        return out

    def _decode_engine_step(self, eng: _Engine, pre: _Engine, now: float) -> int:
        """One step of a decode (or unified) engine; returns the requests it finished."""
        eng.admit(self.kind == "pd")
        eng.retract_for_growth()
        chunks = self._take_chunks(eng) if self.kind == "unified" else []
        decoding = [r for r in eng.running if r.prefilled >= r.input_len]
        context = sum(r.input_len + r.generated for r in decoding) / max(1, len(decoding))
        ms = self._decode_ms(len(decoding), context) if decoding else 0.0
        prompt = [(n, r.prefilled) for r, n in chunks]
        ms += self._prefill_ms(prompt, self.ppar, eager=bool(decoding))
        if self.shared and (pre.running or pre.waiting):
            ms /= MPS_SHARE
        end = now + ms / 1e3
        for r in decoding:
            if r.first_token < 0:  # handed off: prefill sampled its first token
                r.first_token = now
                r.token_times.append(now)
            r.generated += 1
            r.token_times.append(end)
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.input_len:  # the prompt's last chunk samples a token
                r.first_token = end if r.first_token < 0 else r.first_token
                r.token_times.append(end)
        finished = [r for r in eng.running if len(r.token_times) >= r.output_total]
        for r in finished:
            eng.running.remove(r)
            r.done = end
        eng.free_at = end
        return len(finished)
