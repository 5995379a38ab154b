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

Layout: prompt generation and the arrival schedule (prompts.py) and the records and their
statistics (serving_stats.py) are pure functions; :class:`Backend` implementations
(backends.py, offline.py) only move messages; serving_config.py holds the run's config; this
module holds :func:`run_benchmark`, which times requests. Reporting (table, JSON, plot:
serving_report.py) works on the returned :class:`RequestRecord` list. The names ``dsmesh
bench``, the other benchmarks and the tests import from here are re-exported below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from dsmesh.bench.backends import (
    BACKENDS,
    FAILED,
    Backend,
    BenchError,
    GrpcBackend,
    OpenAIBackend,
    RequestError,
    RestBackend,
)
from dsmesh.bench.offline import OfflineBackend
from dsmesh.bench.prompts import BenchRequest, arrival_offsets, load_dataset, sample_random_requests
from dsmesh.bench.serving_config import BenchConfig
from dsmesh.bench.serving_report import format_errors, format_summary, plot_results, result_json
from dsmesh.bench.serving_stats import (
    BenchRun,
    Distribution,
    RequestRecord,
    percentile,
    summarize,
    token_latencies,
    tokens_per_bin,
)
from dsmesh.engine.llm_engine import EngineConfig

__all__ = [  # the runner, and the names imported from here elsewhere
    "BenchConfig",
    "BenchRequest",
    "BenchRun",
    "Distribution",
    "RequestRecord",
    "arrival_offsets",
    "format_errors",
    "format_summary",
    "load_dataset",
    "make_backend",
    "percentile",
    "plot_results",
    "result_json",
    "run_benchmark",
    "sample_random_requests",
    "send_request",
    "send_units",
    "summarize",
    "token_latencies",
    "tokens_per_bin",
]


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
