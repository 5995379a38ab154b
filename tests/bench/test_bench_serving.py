"""The pure parts of the serving benchmark: prompts, schedule, latency split, statistics."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dsmesh.bench.backends import completions_body, completions_chunk, request_json, sse_events
from dsmesh.bench.serving import (
    BenchConfig,
    BenchRequest,
    BenchRun,
    Distribution,
    RequestRecord,
    arrival_offsets,
    format_errors,
    format_summary,
    load_dataset,
    percentile,
    result_json,
    sample_random_requests,
    summarize,
    token_latencies,
    tokens_per_bin,
)
from dsmesh.cli.bench import parse_range

# ------------------------------------------------------------------ prompts


def test_random_requests_respect_ranges_and_seed() -> None:
    reqs = sample_random_requests(400, (5, 9), (2, 4), (3, 20), seed=7)
    assert len(reqs) == 400
    assert {len(r.input_ids) for r in reqs} == {5, 6, 7, 8, 9}  # inclusive bounds, all drawn
    assert {r.max_new_tokens for r in reqs} == {2, 3, 4}
    ids = {t for r in reqs for t in r.input_ids}
    assert ids == set(range(3, 20))  # half-open id range, all drawn
    assert all(r.text == "" for r in reqs)
    assert sample_random_requests(400, (5, 9), (2, 4), (3, 20), seed=7) == reqs
    assert sample_random_requests(400, (5, 9), (2, 4), (3, 20), seed=8) != reqs


def test_random_requests_fixed_lengths() -> None:
    reqs = sample_random_requests(3, (4, 4), (6, 6), seed=0)
    assert [len(r.input_ids) for r in reqs] == [4, 4, 4]
    assert [r.max_new_tokens for r in reqs] == [6, 6, 6]
    assert all(3 <= t < 500 for r in reqs for t in r.input_ids)


def test_random_requests_reject_empty_id_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        sample_random_requests(1, (1, 1), (1, 1), (5, 5))


def test_request_proto_and_rest_body() -> None:
    proto = BenchRequest((7, 8, 9), max_new_tokens=5).to_proto()
    assert proto.sampling.HasField("temperature") and proto.sampling.temperature == 0.0
    assert json.loads(request_json(proto)) == {
        "input_ids": [7, 8, 9],
        "sampling": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    text = json.loads(request_json(BenchRequest(text="hello", max_new_tokens=2).to_proto()))
    assert text["text"] == "hello" and "input_ids" not in text


def test_openai_body_omits_max_tokens_only_without_a_limit() -> None:
    """No limit: no max_tokens and EOS honoured (what an OpenAI client sends); a limit:
    max_tokens with vLLM's ignore_eos, as the Generation API's requests ignore EOS."""
    free = completions_body(BenchRequest((7, 8), max_new_tokens=None).to_proto(), "m")
    assert free == {
        "model": "m",
        "prompt": [7, 8],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    capped = completions_body(BenchRequest(text="hi", max_new_tokens=3).to_proto(), "m")
    assert (capped["prompt"], capped["max_tokens"], capped["ignore_eos"]) == ("hi", 3, True)
    assert sample_random_requests(2, (3, 3), None)[0].max_new_tokens is None


def test_openai_chunks_become_messages() -> None:
    part = {"id": "c1", "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
    msg = completions_chunk(part)
    assert (msg.request_id, msg.text, msg.finish_reason, msg.HasField("usage")) == (
        "c1",
        "ab",
        "",
        False,
    )
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "prompt_tokens_details": None}
    last = completions_chunk({"id": "c1", "choices": [], "usage": usage})
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.text) == (5, 9, "")


def test_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello world", "output_len": 3}\n'
        "\n"
        '{"input_ids": [4, 5, 6], "max_new_tokens": 7}\n'
        '{"input_ids": [9]}\n'
    )
    reqs = load_dataset(path, None, (11, 11))
    assert reqs == [
        BenchRequest((), "hello world", 3),
        BenchRequest((4, 5, 6), "", 7),
        BenchRequest((9,), "", 11),
    ]
    assert load_dataset(path, 5, (11, 11)) == [*reqs, *reqs[:2]]  # repeats a short file


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "prompts.jsonl:2: not JSON"),
        ('{"input_ids": []}', "prompts.jsonl:2: input_ids"),
        ('{"input_ids": ["a"]}', "prompts.jsonl:2: input_ids"),
        ('{"output_len": 3}', "prompts.jsonl:2: needs"),
        ("[1, 2]", "prompts.jsonl:2: expected a JSON object"),
    ],
)
def test_load_dataset_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_dataset(path, None, (1, 1))


@pytest.mark.parametrize(("text", "expected"), [("8", (8, 8)), ("2,16", (2, 16)), ("3,3", (3, 3))])
def test_parse_range(text: str, expected: tuple[int, int]) -> None:
    assert parse_range(text) == expected


@pytest.mark.parametrize("text", ["0", "5,2", "a", "1,2,3", ""])
def test_parse_range_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range(text)


# ------------------------------------------------------------------ schedule


def test_arrivals_all_at_once() -> None:
    assert arrival_offsets(4, math.inf, seed=3) == [0.0, 0.0, 0.0, 0.0]
    assert arrival_offsets(0, 2.0) == []


def test_poisson_arrivals_have_the_requested_rate() -> None:
    rate, n = 20.0, 4001
    offsets = arrival_offsets(n, rate, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    # Exponential gaps: mean 1/rate and coefficient of variation 1 (3% = ~2 sigma at n=4000).
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    assert arrival_offsets(n, rate, seed=0) == offsets
    assert arrival_offsets(n, rate, seed=1) != offsets


def test_arrivals_reject_non_positive_rate() -> None:
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(3, 0.0)


# ------------------------------------------------------------------ statistics


def test_token_latencies_split_multi_token_messages() -> None:
    # sent at 1.0; messages of 2, 1, 3 tokens at 1.25, 1.5, 2.1
    ttft, itls = token_latencies(1.0, [1.25, 1.5, 2.1], [2, 1, 3])
    assert ttft == pytest.approx(0.25)
    assert itls == pytest.approx([0.25, 0.2, 0.2, 0.2])
    assert ttft + sum(itls) == pytest.approx(2.1 - 1.0)
    assert token_latencies(0.0, [], []) == (None, [])


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    values = sorted(np.random.default_rng(n).lognormal(3.0, 1.0, n).tolist())
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_distribution_of_known_values() -> None:
    d = Distribution.of([float(x) for x in range(100, 0, -1)])  # 100..1, unsorted
    assert (d.count, d.mean, d.max) == (100, 50.5, 100.0)
    assert (d.p50, d.p90, d.p99) == pytest.approx((50.5, 90.1, 99.01))
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)


def test_tokens_per_bin() -> None:
    times, counts = [0.1, 0.9, 1.0, 2.5, 3.0], [1, 2, 3, 4, 5]
    assert tokens_per_bin(times, counts, duration_s=3.0, bin_s=1.0) == [3, 3, 9]
    assert tokens_per_bin(times, counts, duration_s=3.0, bin_s=0.5) == [1, 2, 3, 0, 0, 9]
    assert tokens_per_bin([], [], duration_s=0.0, bin_s=1.0) == [0]


def record(
    index: int,
    send: float,
    chunks: list[tuple[float, int]],
    end: float,
    prompt_tokens: int = 10,
    error: str = "",
) -> RequestRecord:
    """A record as send_request builds it; ``chunks`` are (arrival time, tokens)."""
    times, tokens = [t for t, _ in chunks], [k for _, k in chunks]
    ttft, itls = token_latencies(send, times, tokens)
    return RequestRecord(
        index=index,
        max_new_tokens=sum(tokens),
        prompt_tokens=prompt_tokens,
        output_tokens=sum(tokens),
        success=not error,
        error=error,
        finish_reason="" if error else "length",
        request_id=f"r{index}",
        send_s=send,
        ttft_s=ttft,
        e2e_s=end - send,
        itl_s=tuple(itls),
        chunk_times_s=tuple(times),
        chunk_tokens=tuple(tokens),
    )


RECORDS = [
    record(0, 0.0, [(0.1, 1), (0.3, 1), (0.5, 1)], 0.5),  # TTFT 100, ITL 200 200, E2E 500
    record(1, 0.5, [(0.9, 2), (1.5, 2)], 2.0, prompt_tokens=30),  # TTFT 400, ITL 300 300
    record(2, 1.0, [(1.2, 1)], 1.3, error="UNAVAILABLE: gone"),
]


def test_summarize() -> None:
    s = summarize(RECORDS, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (40, 7)  # failed ones not counted
    assert s.request_throughput == 1.0
    assert (s.input_throughput, s.output_throughput, s.total_throughput) == (20.0, 3.5, 23.5)
    assert s.concurrency == pytest.approx((0.5 + 1.5) / 2.0)
    assert (s.ttft_ms.count, s.ttft_ms.mean, s.ttft_ms.max) == (2, pytest.approx(250.0), 400.0)
    assert s.itl_ms.count == 4 and s.itl_ms.mean == pytest.approx(250.0)
    assert s.e2e_ms.mean == pytest.approx(1000.0)
    # TPOT: (500 - 100) / 2 = 200 and (1500 - 400) / 3 = 366.7
    assert s.tpot_ms.mean == pytest.approx((200.0 + 1100.0 / 3) / 2)


def test_summarize_speculation_counts() -> None:
    """Drafts accepted / drafted and tokens per verification over the successful requests;
    nan (and no table rows) when the server reported no speculation."""
    spec = [
        dataclasses.replace(RECORDS[0], spec=(20, 12, 10)),
        dataclasses.replace(RECORDS[1], spec=(10, 3, 5)),
        dataclasses.replace(RECORDS[2], spec=(50, 50, 25)),  # failed: not counted
    ]
    s = summarize(spec, duration_s=2.0)
    assert s.spec_acceptance_rate == pytest.approx(15 / 30)
    assert s.spec_mean_acceptance_length == pytest.approx(1 + 15 / 15)
    plain = summarize(RECORDS, duration_s=2.0)
    assert math.isnan(plain.spec_acceptance_rate) and math.isnan(plain.spec_mean_acceptance_length)


def test_report_table_errors_and_json() -> None:
    config = BenchConfig(request_rate=4.0, max_concurrency=8)
    run = BenchRun(RECORDS, 2.0)
    summary = summarize(RECORDS, 2.0)
    table = format_summary(config, summary)
    assert "Successful requests:                     2" in table
    assert "Failed requests:                         1" in table
    assert "Output token throughput (tok/s):         3.50" in table
    assert "Mean TTFT (ms):                          250.00" in table
    assert "Traffic request rate:                    4" in table
    assert format_errors(RECORDS) == "request 2: UNAVAILABLE: gone"
    assert format_errors(RECORDS[:2]) == ""

    out = result_json(config, summarize(RECORDS[2:], 2.0), run, details=True)
    text = json.dumps(out, allow_nan=False)  # empty statistics are null, not NaN
    back = json.loads(text)
    assert back["summary"]["failed"] == 1 and back["summary"]["ttft_ms"]["mean"] is None
    assert back["errors"] == [{"index": 2, "error": "UNAVAILABLE: gone"}]
    assert [r["index"] for r in back["requests"]] == [0, 1, 2]
    assert back["requests"][1]["itl_s"] == pytest.approx([0.3, 0.3])
    assert "requests" not in result_json(config, summary, run, details=False)


def test_many_errors_are_cut_short() -> None:
    failed = [record(i, 0.0, [], 0.1, error=f"boom {i}") for i in range(8)]
    assert format_errors(failed).splitlines() == [
        *(f"request {i}: boom {i}" for i in range(5)),
        "... and 3 more failed requests",
    ]


# ------------------------------------------------------------------ SSE


async def _lines(*lines: bytes):
    for line in lines:
        yield line


async def _collect(*lines: bytes) -> list[tuple[str, str]]:
    return [e async for e in sse_events(_lines(*lines))]


@pytest.mark.asyncio
async def test_sse_events() -> None:
    events = await _collect(
        b": keep-alive comment\n",
        b'data: {"a": 1}\r\n',
        b"\r\n",
        b"id: 7\n",
        b"data:x\n",
        b"data: y\n",
        b"\n",
        b"\n",
        b"event: error\n",
        b"data: bad\n",
        b"\n",
        b"data: [DONE]\n",  # last event without a blank line
    )
    assert events == [
        ("message", '{"a": 1}'),
        ("message", "x\ny"),
        ("error", "bad"),
        ("message", "[DONE]"),
    ]
