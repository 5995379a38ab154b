"""The serving benchmark's measurements and their statistics: one :class:`RequestRecord` per
timed request (TTFT, inter-token latencies, E2E, tokens, cached tokens, outcome), the split of
a request's message arrivals into TTFT and ITLs, percentiles and latency distributions, tokens
per time bin, and :func:`summarize` over a run (:class:`BenchRun`: its records and duration;
:class:`BenchSummary`). Pure functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsmesh.bench.backends import REFUSED, TIMED_OUT


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


@dataclass(frozen=True)
class BenchRun:
    records: list[RequestRecord]  # in request order
    duration_s: float  # first send to last completion
