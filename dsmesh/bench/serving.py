"""Serving benchmark client for the gateway's ``dsmesh.v1.Generation`` API (gRPC or REST/SSE)
and its OpenAI ``/v1/completions`` route.

In the spirit of ``sglang.bench_serving``: requests arrive as a Poisson process (or all at
once), optionally capped by a client-side concurrency limit; per request we record time to
first token (TTFT), inter-token latencies (ITL), end-to-end latency (E2E) and the prompt
tokens a prefix cache served (as the server reports them). The turns of a conversation
(dsmesh/bench/workloads.py, multi-turn) go one after another, each resending the history. A request
with no ``max_new_tokens`` (``--output-len context``, OpenAI backend only) sends no
``max_tokens`` and honours EOS, as OpenAI clients do: the server's default, up to the context
limit, applies. Failures are counted by outcome: refused (429), timed out, or other.

Layout: prompt generation, arrival schedule, latency split and statistics are pure functions;
:class:`Backend` implementations only move messages; :func:`run_benchmark` times requests.
Reporting (table, JSON, plot) works on the returned :class:`RequestRecord` list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsmesh.bench.backends import (
    BACKENDS,
    FAILED,
    REFUSED,
    TIMED_OUT,
    Backend,
    BenchError,
    GrpcBackend,
    OpenAIBackend,
    RequestError,
    RestBackend,
)
from dsmesh.bench.offline import OfflineBackend
from dsmesh.engine.llm_engine import EngineConfig
from dsmesh.v1 import generation_pb2 as pb

MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; ``dsmesh bench`` maps its flags onto this in one place."""

    backend: str = "grpc"  # one of BACKENDS
    grpc_addr: str = "127.0.0.1:50051"
    url: str = "http://127.0.0.1:8000"  # REST base URL
    request_rate: float = math.inf  # requests/s of the Poisson arrivals; inf = all at once
    max_concurrency: int | None = None  # requests in flight at most (client-side semaphore)
    warmup: int = 1  # requests sent before timing, not counted
    warmup_concurrency: int = 1  # warm-up requests in flight at once
    seed: int = 0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # deadline of each request
    # offline backend: the engine's config (dsmesh.engine.llm_engine.EngineConfig; None = defaults,
    # the tiny model), so the in-process baseline runs the same engine the mesh runs
    engine: Any = None

    @property
    def target(self) -> str:
        if self.backend == "offline":
            model = getattr(self.engine, "model", None)
            return f"offline engine ({model or 'tiny default model'})"
        if self.backend == "openai":
            return f"{self.url}/v1/completions"
        return self.grpc_addr if self.backend == "grpc" else self.url


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: token ids, or text that the gateway tokenizes.

    A turn of a conversation (``conversation`` >= 0) holds only its new tokens: it is sent
    after the conversation's previous turn ended, prefixed with that turn's prompt and the
    tokens the server answered. ``max_new_tokens`` None: no limit sent, EOS honoured (the
    OpenAI backend omits ``max_tokens``); else exactly that many tokens, EOS ignored."""

    input_ids: tuple[int, ...] = ()
    text: str = ""
    max_new_tokens: int | None = 16
    conversation: int = -1  # -1: a request on its own
    turn: int = 0

    def to_proto(self) -> pb.GenerateRequest:
        # temperature is optional in the proto: set it explicitly so that 0 means greedy.
        sampling = pb.SamplingParams(temperature=0.0)
        if self.max_new_tokens is not None:
            sampling.max_new_tokens = self.max_new_tokens
            sampling.ignore_eos = True
        return pb.GenerateRequest(
            input_ids=self.input_ids, text=self.text, sampling=sampling, stream=True
        )


def _uniform_lengths(rng: np.random.Generator, bounds: tuple[int, int], num: int) -> list[int]:
    low, high = bounds
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def sample_random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int] | None,
    token_id_range: tuple[int, int] = (3, 500),
    seed: int = 0,
) -> list[BenchRequest]:
    """Synthetic prompts of random token ids.

    Lengths are uniform integers in the inclusive ranges ``input_len`` and ``output_len``
    (None: no limit, up to the context); token ids are uniform in the half-open
    ``token_id_range``. Same seed, same prompts.
    """
    low_id, high_id = token_id_range
    if not 0 <= low_id < high_id:
        raise ValueError(f"token id range [{low_id}, {high_id}) is empty or negative")
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lengths(rng, input_len, num_prompts)
    output_lens: list[int | None] = (
        [None] * num_prompts
        if output_len is None
        else list(_uniform_lengths(rng, output_len, num_prompts))
    )
    return [
        BenchRequest(
            input_ids=tuple(int(t) for t in rng.integers(low_id, high_id, size=n_in)),
            max_new_tokens=n_out,
        )
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def load_dataset(
    path: str | Path,
    num_prompts: int | None,
    output_len: tuple[int, int] | None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts from a JSON Lines file, one object per line.

    Each line has ``prompt`` (text) or ``input_ids`` (list of ints), and optionally
    ``output_len`` or ``max_new_tokens``; lines without one draw it uniformly from
    ``output_len`` (None: no limit). ``num_prompts`` takes the first N lines, repeating the
    file if it is shorter; None takes every line.
    """
    items: list[tuple[tuple[int, ...], str, int | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ids, text = obj.get("input_ids"), obj.get("prompt")
            if ids is not None:
                if not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{where}: input_ids must be a non-empty list of ints")
                items.append((tuple(ids), "", obj.get("output_len", obj.get("max_new_tokens"))))
            elif isinstance(text, str) and text:
                items.append(((), text, obj.get("output_len", obj.get("max_new_tokens"))))
            else:
                raise ValueError(f"{where}: needs a non-empty 'prompt' or 'input_ids'")
    if not items:
        raise ValueError(f"{path}: no prompts")
    num = len(items) if num_prompts is None else num_prompts
    drawn: list[int | None] = (
        [None] * num
        if output_len is None
        else list(_uniform_lengths(np.random.default_rng(seed), output_len, num))
    )
    requests = []
    for i in range(num):
        ids, text, n_out = items[i % len(items)]
        requests.append(BenchRequest(ids, text, int(n_out) if n_out is not None else drawn[i]))
    return requests


# --------------------------------------------------------------------------- schedule


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start.

    A Poisson process: the first request at 0, then exponential gaps of mean
    ``1 / request_rate``. ``inf`` sends everything at 0. The generator is seeded apart from
    the prompts', so changing the rate keeps the prompts.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = np.random.default_rng((seed, 1)).exponential(1.0 / request_rate, num_requests - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]


# --------------------------------------------------------------------------- statistics


def token_latencies(
    send_s: float, chunk_times_s: Sequence[float], chunk_tokens: Sequence[int]
) -> tuple[float | None, list[float]]:
    """TTFT and inter-token latencies of one request, in seconds.

    ``chunk_times_s[i]`` is when the i-th token-bearing message arrived, carrying
    ``chunk_tokens[i]`` tokens. TTFT is the first arrival minus ``send_s`` (None without
    tokens). A later message of k tokens arriving g after the previous one adds k ITLs of
    g / k; extra tokens of the first message add none. So TTFT + sum(ITL) is the time of the
    last token and there is one ITL per token after the first message.
    """
    if not chunk_times_s:
        return None, []
    itls: list[float] = []
    for i in range(1, len(chunk_times_s)):
        gap = chunk_times_s[i] - chunk_times_s[i - 1]
        itls.extend([gap / chunk_tokens[i]] * chunk_tokens[i])
    return chunk_times_s[0] - send_s, itls


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, interpolating linearly between the
    two nearest ranks (numpy's default method); nan when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency sample, in milliseconds; nan figures when empty."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        xs = sorted(values)
        mean = math.fsum(xs) / len(xs) if xs else math.nan
        top = xs[-1] if xs else math.nan
        p = [percentile(xs, q) for q in (50, 90, 99)]
        return cls(len(xs), mean, p[0], p[1], p[2], top)


def tokens_per_bin(
    chunk_times_s: Sequence[float], chunk_tokens: Sequence[int], duration_s: float, bin_s: float
) -> list[int]:
    """Tokens that arrived in each ``bin_s``-wide bin of ``[0, duration_s)``; arrivals at or
    after the end fall into the last bin."""
    num_bins = max(1, math.ceil(duration_s / bin_s))
    bins = [0] * num_bins
    for t, k in zip(chunk_times_s, chunk_tokens, strict=True):
        bins[min(max(int(t // bin_s), 0), num_bins - 1)] += k
    return bins


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RequestRecord:
    """One timed request. Times in seconds, relative to the start of the timed run."""

    index: int
    max_new_tokens: int | None  # None: no limit was sent
    prompt_tokens: int  # len(input_ids), or the server's usage for text prompts (0 if unknown)
    output_tokens: int
    success: bool
    error: str
    finish_reason: str
    request_id: str
    send_s: float
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]
    chunk_times_s: tuple[float, ...]  # arrival of each token-bearing message
    chunk_tokens: tuple[int, ...]  # tokens in each of those messages
    cached_tokens: int = 0  # prompt tokens a prefix cache served, as the server reported
    # speculative decoding, as the server reported it: (drafted, accepted, verifications)
    spec: tuple[int, int, int] = (0, 0, 0)
    outcome: str = "ok"  # "ok", or FAILED, REFUSED (429) or TIMED_OUT (dsmesh/bench/backends.py)


@dataclass(frozen=True)
class BenchSummary:
    """The figures of one run; latencies in milliseconds, throughputs per second."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float  # mean requests in flight: sum of E2E / duration
    ttft_ms: Distribution
    tpot_ms: Distribution  # (E2E - TTFT) / (output tokens - 1), per request
    itl_ms: Distribution
    e2e_ms: Distribution
    total_cached_tokens: int = 0  # prompt tokens prefix caches served
    mean_cached_tokens: float = math.nan  # per successful request
    cache_hit_rate: float = math.nan  # cached / input tokens
    # speculative decoding: drafts accepted / drafted, and tokens per verification
    # (accepted drafts + the target's own); nan when the server did not speculate
    spec_acceptance_rate: float = math.nan
    spec_mean_acceptance_length: float = math.nan
    # of ``failed``: refused for lack of room (429 / RESOURCE_EXHAUSTED), and past a deadline
    refused: int = 0
    timed_out: int = 0
    # output tokens of each successful request, and how many ended for each finish reason
    output_tokens: Distribution = field(default_factory=lambda: Distribution.of([]))
    finish_reasons: dict[str, int] = field(default_factory=dict)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    """Aggregate the successful requests; failed ones count only in ``failed``."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    drafted, accepted, verifications = (sum(r.spec[i] for r in ok) for i in range(3))
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3
        for r in ok
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    return BenchSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) * per_s,
        input_throughput=total_in * per_s,
        output_throughput=total_out * per_s,
        total_throughput=(total_in + total_out) * per_s,
        concurrency=math.fsum(r.e2e_s for r in ok) * per_s,
        ttft_ms=Distribution.of([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]),
        tpot_ms=Distribution.of(tpot),
        itl_ms=Distribution.of([x * 1e3 for r in ok for x in r.itl_s]),
        e2e_ms=Distribution.of([r.e2e_s * 1e3 for r in ok]),
        total_cached_tokens=total_cached,
        mean_cached_tokens=total_cached / len(ok) if ok else math.nan,
        cache_hit_rate=total_cached / total_in if total_in else math.nan,
        spec_acceptance_rate=accepted / drafted if drafted else math.nan,
        spec_mean_acceptance_length=1 + accepted / verifications if verifications else math.nan,
        refused=sum(1 for r in records if r.outcome == REFUSED),
        timed_out=sum(1 for r in records if r.outcome == TIMED_OUT),
        output_tokens=Distribution.of([r.output_tokens for r in ok]),
        finish_reasons={
            reason: sum(1 for r in ok if r.finish_reason == reason)
            for reason in sorted({r.finish_reason for r in ok})
        },
    )


# --------------------------------------------------------------------------- backends


def make_backend(
    kind: str, grpc_addr: str, url: str, engine: EngineConfig | None = None
) -> Backend:
    """``kind`` is one of :data:`BACKENDS`; ``engine`` configures the offline one."""
    if kind == "grpc":
        return GrpcBackend(grpc_addr)
    if kind == "rest":
        return RestBackend(url)
    if kind == "openai":
        return OpenAIBackend(url)
    if kind == "offline":
        return OfflineBackend(engine)
    raise ValueError(f"unknown backend {kind!r}; choose from {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------- running


async def send_request(
    backend: Backend,
    request: BenchRequest,
    index: int,
    t0: float,
    timeout_s: float,
    output_ids: list[int] | None = None,
) -> RequestRecord:
    """Send one request and time its messages against ``t0`` (a ``perf_counter`` value);
    the tokens received are appended to ``output_ids`` when given (backends that send token
    ids). From a backend that sends text (OpenAI), a message with text counts as one token
    and the last one takes the rest of the usage's completion tokens."""
    chunk_times: list[float] = []
    chunk_tokens: list[int] = []
    finish_reason, request_id, error, outcome = "", "", "", "ok"
    prompt_tokens = len(request.input_ids)
    cached_tokens = completion_tokens = 0
    spec = (0, 0, 0)
    send = time.perf_counter()
    try:
        async for resp in backend.generate(request.to_proto(), timeout_s):
            now = time.perf_counter()
            num_tokens = len(resp.token_ids) if backend.sends_token_ids else int(bool(resp.text))
            if num_tokens:
                chunk_times.append(now - t0)
                chunk_tokens.append(num_tokens)
                if output_ids is not None:
                    output_ids.extend(resp.token_ids)
            request_id = resp.request_id or request_id
            finish_reason = resp.finish_reason or finish_reason
            if resp.HasField("usage"):
                completion_tokens = resp.usage.completion_tokens or completion_tokens
                cached_tokens = resp.usage.cached_tokens or cached_tokens
                if resp.usage.HasField("spec"):
                    u = resp.usage.spec
                    spec = (u.draft_tokens, u.accepted_tokens, u.verifications)
                if resp.usage.prompt_tokens and not request.input_ids:
                    prompt_tokens = resp.usage.prompt_tokens
    except RequestError as exc:
        error, outcome = str(exc), exc.outcome
    except Exception as exc:  # a record per failure; one bad request must not end the run
        error, outcome = f"{type(exc).__name__}: {exc}", FAILED
    end = time.perf_counter()
    if not error and finish_reason not in ("stop", "length"):
        error = f"finish_reason {finish_reason!r}" if finish_reason else "stream ended early"
        outcome = FAILED
    if not backend.sends_token_ids and chunk_tokens and completion_tokens > sum(chunk_tokens):
        chunk_tokens[-1] += completion_tokens - sum(chunk_tokens)  # chunks that held several
    ttft, itls = token_latencies(send - t0, chunk_times, chunk_tokens)
    return RequestRecord(
        index=index,
        max_new_tokens=request.max_new_tokens,
        prompt_tokens=prompt_tokens,
        output_tokens=sum(chunk_tokens),
        success=not error,
        error=error,
        finish_reason=finish_reason,
        request_id=request_id,
        send_s=send - t0,
        ttft_s=ttft,
        e2e_s=end - send,
        itl_s=tuple(itls),
        chunk_times_s=tuple(chunk_times),
        chunk_tokens=tuple(chunk_tokens),
        cached_tokens=cached_tokens,
        spec=spec,
        outcome=outcome,
    )


def skipped_record(request: BenchRequest, index: int, error: str) -> RequestRecord:
    """A request never sent (a conversation's turn after a failed one)."""
    return RequestRecord(
        index=index,
        max_new_tokens=request.max_new_tokens,
        prompt_tokens=0,
        output_tokens=0,
        success=False,
        error=error,
        finish_reason="",
        request_id="",
        send_s=0.0,
        ttft_s=None,
        e2e_s=0.0,
        itl_s=(),
        chunk_times_s=(),
        chunk_tokens=(),
        outcome=FAILED,
    )


def send_units(requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Indices of ``requests`` grouped into what is sent one after another: each
    conversation's turns (in turn order), and every other request alone; ordered by each
    unit's first request. Arrivals are scheduled per unit."""
    units: list[list[int]] = []
    by_conversation: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        if request.conversation < 0:
            units.append([i])
        elif request.conversation in by_conversation:
            by_conversation[request.conversation].append(i)
        else:
            by_conversation[request.conversation] = [i]
            units.append(by_conversation[request.conversation])
    for unit in units:
        unit.sort(key=lambda i: requests[i].turn)
    return units


@dataclass(frozen=True)
class BenchRun:
    records: list[RequestRecord]  # in request order
    duration_s: float  # first send to last completion


def warmup_request(request: BenchRequest) -> BenchRequest:
    """A warm-up twin of a timed request: its token ids reversed, so it warms the same shapes
    without leaving a prefix in any cache that the timed request would then hit."""
    return dataclasses.replace(request, input_ids=tuple(reversed(request.input_ids)))


async def _warm_up(backend: Backend, config: BenchConfig, requests: Sequence[BenchRequest]) -> None:
    """``config.warmup`` untimed requests (twins of the first timed ones), at most
    ``config.warmup_concurrency`` at once: at the run's concurrency they take the server
    through the batch sizes and shapes the run will hit (graphs, JIT-compiled kernels)."""
    limit = asyncio.Semaphore(max(1, config.warmup_concurrency))

    async def one(i: int) -> RequestRecord:
        async with limit:
            warm = warmup_request(requests[i % len(requests)])
            return await send_request(
                backend, warm, -1, time.perf_counter(), config.request_timeout_s
            )

    records = await asyncio.gather(*(one(i) for i in range(config.warmup)))
    failed = [r for r in records if not r.success]
    if failed:
        raise BenchError(f"warm-up request failed: {failed[0].error}")


async def run_benchmark(
    config: BenchConfig,
    requests: Sequence[BenchRequest],
    on_done: Callable[[RequestRecord], None] | None = None,
    backend: Backend | None = None,
) -> BenchRun:
    """Connect, warm up, then send ``requests`` on the configured schedule.

    Raises :class:`BenchError` when the server cannot be reached or a warm-up request
    fails. ``on_done`` is called as each timed request finishes (e.g. a progress bar).
    ``backend``: one already connected, kept open for the caller (several runs on one
    engine); by default one is made from ``config`` and closed at the end.
    """
    if not requests:
        raise ValueError("no requests to send")
    units = send_units(requests)
    offsets = arrival_offsets(len(units), config.request_rate, config.seed)
    owned = backend is None
    if backend is None:
        backend = make_backend(config.backend, config.grpc_addr, config.url, config.engine)
    try:
        if owned:
            await backend.connect(config.connect_timeout_s)
        await _warm_up(backend, config, requests)

        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        t0 = time.perf_counter()
        records: list[RequestRecord | None] = [None] * len(requests)

        async def send(request: BenchRequest, index: int, output_ids: list[int]) -> None:
            timeout = config.request_timeout_s
            if limit is None:
                rec = await send_request(backend, request, index, t0, timeout, output_ids)
            else:
                async with limit:
                    rec = await send_request(backend, request, index, t0, timeout, output_ids)
            records[index] = rec
            if on_done is not None:
                on_done(rec)

        async def unit(u: int) -> None:
            """One request, or a conversation's turns, each after the history so far."""
            await asyncio.sleep(max(0.0, t0 + offsets[u] - time.perf_counter()))
            history: tuple[int, ...] = ()
            for index in units[u]:
                request = requests[index]
                if history:
                    request = dataclasses.replace(request, input_ids=history + request.input_ids)
                output_ids: list[int] = []
                await send(request, index, output_ids)
                if not records[index].success:  # type: ignore[union-attr]
                    break  # the later turns have no history to resend
                history = request.input_ids + tuple(output_ids)
            for index in units[u]:
                if records[index] is None:
                    rec = skipped_record(requests[index], index, "an earlier turn failed")
                    records[index] = rec
                    if on_done is not None:
                        on_done(rec)

        await asyncio.gather(*(unit(u) for u in range(len(units))))
        return BenchRun([r for r in records if r is not None], time.perf_counter() - t0)
    finally:
        if owned:
            await backend.close()


# --------------------------------------------------------------------------- reporting


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value}"


def format_summary(config: BenchConfig, summary: BenchSummary) -> str:
    """The sglang-style result table."""
    s = summary
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _row("Backend:", f"{config.backend} ({config.target})"),
        _row("Traffic request rate:", rate),
        _row("Max request concurrency:", config.max_concurrency or "not set"),
        _row("Successful requests:", s.completed),
        _row("Failed requests:", s.failed),
        _row("  of which refused (429):", s.refused),
        _row("  of which timed out:", s.timed_out),
        _row("Benchmark duration (s):", s.duration_s),
        _row("Total input tokens:", s.total_input_tokens),
        _row("Total generated tokens:", s.total_output_tokens),
        _row("Output tokens per request (mean):", s.output_tokens.mean),
        _row("Output tokens per request (max):", s.output_tokens.max),
        _row(
            "Finish reasons:",
            ", ".join(f"{k or 'none'} {v}" for k, v in s.finish_reasons.items()) or "n/a",
        ),
        _row("Total cached prompt tokens:", s.total_cached_tokens),
        _row("Mean cached tokens per request:", s.mean_cached_tokens),
        _row("Prompt cache hit rate (%):", s.cache_hit_rate * 100),
        *(
            []
            if math.isnan(s.spec_mean_acceptance_length)
            else [
                _row("Draft acceptance rate (%):", s.spec_acceptance_rate * 100),
                _row("Mean acceptance length:", s.spec_mean_acceptance_length),
            ]
        ),
        _row("Request throughput (req/s):", s.request_throughput),
        _row("Input token throughput (tok/s):", s.input_throughput),
        _row("Output token throughput (tok/s):", s.output_throughput),
        _row("Total token throughput (tok/s):", s.total_throughput),
        _row("Concurrency:", s.concurrency),
    ]
    sections = [
        ("End-to-End Latency", "E2E Latency", s.e2e_ms),
        ("Time to First Token", "TTFT", s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms),
        ("Inter-Token Latency", "ITL", s.itl_ms),
    ]
    for title, name, dist in sections:
        lines.append(f"{title:-^50}")
        lines.append(_row(f"Mean {name} (ms):", dist.mean))
        lines.append(_row(f"P50 {name} (ms):", dist.p50))
        lines.append(_row(f"P90 {name} (ms):", dist.p90))
        lines.append(_row(f"P99 {name} (ms):", dist.p99))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(records: Sequence[RequestRecord], limit: int = MAX_ERRORS_SHOWN) -> str:
    """The first ``limit`` failures, one line each; empty when all succeeded."""
    failed = [r for r in records if not r.success]
    lines = [f"request {r.index}: {r.error}" for r in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more failed requests")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no nan: empty statistics become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def result_json(
    config: BenchConfig, summary: BenchSummary, run: BenchRun, details: bool
) -> dict[str, Any]:
    """Everything the table shows, plus the config and the first errors; with ``details``
    also one object per request."""
    out: dict[str, Any] = {
        "config": _finite(dataclasses.asdict(config)),
        "summary": _finite(dataclasses.asdict(summary)),
        "errors": [
            {"index": r.index, "error": r.error}
            for r in [r for r in run.records if not r.success][:MAX_ERRORS_SHOWN]
        ],
    }
    if details:
        out["requests"] = [_finite(dataclasses.asdict(r)) for r in run.records]
    return out


def plot_results(run: BenchRun, path: str | Path, bin_s: float = 1.0) -> None:
    """One PNG: CDFs of TTFT, ITL and E2E (ms), and output tokens/s over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in run.records if r.success]
    samples = {
        "TTFT": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
        "ITL": [x * 1e3 for r in ok for x in r.itl_s],
        "E2E latency": [r.e2e_s * 1e3 for r in ok],
    }
    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flat
    for ax, (name, values) in zip(axes, samples.items(), strict=False):
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), drawstyle="steps-post")
        ax.set(title=f"{name} CDF (n={len(xs)})", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    times = [t for r in ok for t in r.chunk_times_s]
    counts = [k for r in ok for k in r.chunk_tokens]
    bins = tokens_per_bin(times, counts, run.duration_s, bin_s)
    starts = [i * bin_s for i in range(len(bins))]
    # the last bin ends with the run: divide by its real width, not bin_s
    widths = [min(bin_s, max(run.duration_s - t, 1e-9)) for t in starts]
    ax = fig.axes[3]
    ax.bar(starts, [b / w for b, w in zip(bins, widths, strict=True)], width=widths, align="edge")
    ax.set(title=f"Output throughput ({bin_s:g} s bins)", xlabel="s since start", ylabel="tok/s")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{len(ok)} requests, {run.duration_s:.2f} s")
    fig.savefig(path, dpi=100)
