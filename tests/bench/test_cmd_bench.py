"""``dsmesh bench`` end to end against a protocol double of the gateway (real gRPC and HTTP
servers on loopback), through the real CLI entry point."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsmesh.bench.serving import arrival_offsets, sample_random_requests
from dsmesh.cli.main import main
from tests.bench.fake_gateway import (
    CONTEXT,
    DEADLINE_TOKEN,
    MODEL,
    REFUSE_TOKEN,
    TOKENS_PER_MESSAGE,
    FakeGateway,
    running_fake_gateway,
)

BACKENDS = ("grpc", "rest")


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeGateway]:
    with running_fake_gateway() as gw:
        yield gw


def target(gateway: FakeGateway, backend: str) -> list[str]:
    if backend == "grpc":
        return ["--backend", "grpc", "--grpc-addr", gateway.grpc_addr]
    return ["--backend", "rest", "--url", gateway.url]


def bench(*args: str) -> int:
    return main(["bench", "--no-progress", "--connect-timeout", "2", *args])


def max_overlap(records: list[dict[str, Any]]) -> int:
    """Requests in flight at once at most, from the recorded send and end times."""
    edges = sorted(
        [(r["send_s"], 1) for r in records] + [(r["send_s"] + r["e2e_s"], -1) for r in records],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_prompts_summary_is_consistent(
    gateway: FakeGateway, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    rc = bench(
        *target(gateway, backend),
        *("--num-prompts", "12", "--input-len", "4,16", "--output-len", "3,9", "--seed", "5"),
        *("--max-concurrency", "4", "--json", str(out), "--json-details"),
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "Successful requests:                     12" in table
    assert "Failed requests:                         0" in table

    expected = sample_random_requests(12, (4, 16), (3, 9), (3, 500), seed=5)
    result = json.loads(out.read_text())
    s, records = result["summary"], result["requests"]
    assert (s["completed"], s["failed"], result["errors"]) == (12, 0, [])
    assert s["total_output_tokens"] == sum(r.max_new_tokens for r in expected)
    assert s["total_input_tokens"] == sum(len(r.input_ids) for r in expected)
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["ttft_ms"]["count"] == 12
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]
    assert max_overlap(records) <= 4

    for rec, req in zip(records, expected, strict=True):
        out_tokens = req.max_new_tokens
        assert rec["success"] and rec["finish_reason"] == "length"
        assert rec["output_tokens"] == out_tokens == sum(rec["chunk_tokens"])
        assert rec["prompt_tokens"] == len(req.input_ids)
        assert 0 < rec["ttft_s"] <= rec["e2e_s"]
        # the double sends 2 tokens a message: one ITL per token after the first message
        assert len(rec["itl_s"]) == out_tokens - min(TOKENS_PER_MESSAGE, out_tokens)
        assert rec["ttft_s"] + sum(rec["itl_s"]) <= rec["e2e_s"] + 1e-9
    assert s["itl_ms"]["count"] == sum(len(r["itl_s"]) for r in records)


def test_poisson_schedule_is_followed(gateway: FakeGateway, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    rc = bench(
        *target(gateway, "grpc"),
        *("--num-prompts", "10", "--input-len", "4", "--output-len", "2", "--seed", "3"),
        *("--request-rate", "40", "--json", str(out), "--json-details"),
    )
    assert rc == 0
    sends = [r["send_s"] for r in json.loads(out.read_text())["requests"]]
    for sent, planned in zip(sends, arrival_offsets(10, 40.0, seed=3), strict=True):
        # the event loop's timers have 1 ms resolution: a send may come a hair early
        assert planned - 0.002 <= sent < planned + 0.1


@pytest.mark.parametrize(
    ("backend", "error"),
    [
        ("grpc", "request 2: INVALID_ARGUMENT: input_ids[1] = 5000 out of range [0, 1000)"),
        ("rest", 'request 2: HTTP 400: {"error": "input_ids[1] = 5000 out of range [0, 1000)"}'),
    ],
)
def test_failed_requests_are_counted_and_shown(
    gateway: FakeGateway,
    backend: str,
    error: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        '{"input_ids": [5, 6, 7], "output_len": 4}\n'
        '{"prompt": "three word prompt", "max_new_tokens": 3}\n'
        '{"input_ids": [1, 5000], "output_len": 2}\n'
    )
    rc = bench(*target(gateway, backend), "--dataset", str(dataset), "--json", "-")
    assert rc == 1
    captured = capsys.readouterr()
    assert error in captured.err
    assert "Failed requests:                         1" in captured.err  # table on stderr
    result = json.loads(captured.out)  # stdout is the JSON alone
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (3 + 3, 4 + 3)
    assert result["errors"] == [{"index": 2, "error": error.removeprefix("request 2: ")}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_warmup_stops_the_run(
    gateway: FakeGateway, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text('{"input_ids": [9999]}\n')
    assert bench(*target(gateway, backend), "--dataset", str(dataset)) == 1
    captured = capsys.readouterr()
    assert "dsmesh bench: error: warm-up request failed:" in captured.err
    assert captured.out == ""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grpc-addr", "127.0.0.1:{port}", "--connect-timeout", "0.3"], "cannot reach gRPC"),
        (["--backend", "rest", "--url", "http://127.0.0.1:{port}"], "cannot reach REST"),
    ],
)
def test_unreachable_server_exits_nonzero(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    port = closed_port()
    rc = main(["bench", "--no-progress", *(a.format(port=port) for a in args)])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"dsmesh bench: error: {message}" in err and str(port) in err


def test_plot_and_progress_bar(
    gateway: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "bench.png"
    rc = main(
        [
            "bench",
            *target(gateway, "rest"),
            *("--num-prompts", "6", "--input-len", "3", "--output-len", "5,8"),
            *("--plot", str(plot)),
        ]
    )
    assert rc == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert "6/6" in capsys.readouterr().err  # tqdm's final state


def test_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json-details"]) == 2
    assert "--json-details needs --json" in capsys.readouterr().err
    assert main(["bench", "--output-len", "context"]) == 2  # the Generation API has no "no limit"
    assert "--output-len context needs --backend openai" in capsys.readouterr().err
    assert main(["bench", "--request-rate", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--input-len", "9,3"])


def test_offline_backend_reports_the_mean_acceptance_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--backend offline`` with ``--speculative mtp`` on a checkpoint with an MTP layer:
    the table and the JSON report the acceptance the engine's usage reported."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3

    _, ckpt = make_hf_v3(tmp_path / "mtp", seed=7, vocab_size=4)
    add_mtp_layer(ckpt, seed=8)
    # the offline backend loads a tokenizer; the prompts are token ids in [0, 3]
    words = Tokenizer(WordLevel({"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    words.save(str(ckpt / "tokenizer.json"))
    out = tmp_path / "result.json"
    args = ["--backend", "offline", "--model", str(ckpt), "--page-size", "4"]
    args += ["--speculative", "mtp", "--num-draft-tokens", "2", "--max-total-tokens", "4096"]
    args += ["--num-prompts", "6", "--max-concurrency", "3", "--input-len", "8,24"]
    args += ["--output-len", "24", "--min-token-id", "0", "--max-token-id", "3", "--seed", "3"]
    assert bench(*args, "--json", str(out)) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 6
    assert 0 < summary["spec_acceptance_rate"] <= 1
    assert 1 < summary["spec_mean_acceptance_length"] <= 3
    assert "Mean acceptance length:" in capsys.readouterr().out


def test_openai_backend_without_max_tokens_runs_to_the_context_limit(
    gateway: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output-len context``: no max_tokens in any body, EOS not ignored; each request's
    output tokens come from the usage (a chunk carries text of several tokens)."""
    out = tmp_path / "result.json"
    sent = len(gateway.completions_bodies)
    rc = bench(
        *("--backend", "openai", "--url", gateway.url, "--output-len", "context"),
        *("--num-prompts", "5", "--input-len", "4,12", "--seed", "2", "--warmup", "0"),
        *("--json", str(out), "--json-details"),
    )
    assert rc == 0
    bodies = gateway.completions_bodies[sent:]
    expected = sample_random_requests(5, (4, 12), None, (3, 500), seed=2)
    assert sorted(b["prompt"] for b in bodies) == sorted(list(r.input_ids) for r in expected)
    for body in bodies:
        assert body["model"] == MODEL and body["stream"] and body["temperature"] == 0.0
        assert "max_tokens" not in body and "ignore_eos" not in body
    result = json.loads(out.read_text())
    for rec in result["requests"]:
        assert rec["max_new_tokens"] is None and rec["finish_reason"] == "length"
        assert rec["prompt_tokens"] + rec["output_tokens"] == CONTEXT
        assert sum(rec["chunk_tokens"]) == rec["output_tokens"]
    s = result["summary"]
    assert s["output_tokens"]["max"] == CONTEXT - 4 and s["finish_reasons"] == {"length": 5}
    assert "Output tokens per request (max):         36" in capsys.readouterr().out


def test_openai_backend_counts_refusals_and_timeouts_apart(
    gateway: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        '{"input_ids": [5, 6, 7], "output_len": 4}\n'
        f'{{"input_ids": [{REFUSE_TOKEN}, 6], "output_len": 4}}\n'
        f'{{"input_ids": [{DEADLINE_TOKEN}, 6], "output_len": 6}}\n'
    )
    out = tmp_path / "result.json"
    args = ["--backend", "openai", "--url", gateway.url, "--dataset", str(dataset)]
    assert bench(*args, "--warmup", "0", "--json", str(out), "--json-details") == 1
    assert gateway.completions_bodies[-1]["max_tokens"] in (4, 6)
    result = json.loads(out.read_text())
    assert [r["outcome"] for r in result["requests"]] == ["ok", "refused", "timed_out"]
    s = result["summary"]
    assert (s["completed"], s["failed"], s["refused"], s["timed_out"]) == (1, 2, 1, 1)
    assert result["requests"][0]["output_tokens"] == 4
    table = capsys.readouterr().out
    assert "  of which refused (429):                1" in table
    assert "  of which timed out:                    1" in table
