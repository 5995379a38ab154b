"""dsmesh/bench/faults.py: the fault benchmark end to end on the CPU (a real ``dsmesh up`` of the
tiny model, decode SIGKILLed under load), its flags' validation, and its pure figures
(dsmesh/bench/fault_report.py) on records whose answers are known.

The end-to-end assertions hold whether or not the gateway migrates requests; 0 failed is
required only from a gateway that counts migrations (``dsmesh_requests_migrated_total``)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from dsmesh.bench import faults
from dsmesh.bench.fault_report import (
    SupervisorLine,
    delivered_tokens,
    failures,
    first_served_after,
    parse_supervisor_line,
    recovery,
    timeline,
)
from dsmesh.bench.serving_stats import RequestRecord
from dsmesh.cli.mesh_config import RestartPolicy
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.options.fields import option_fields

# ---- the benchmark through `dsmesh up` ------------------------------------------------------

NUM, CONCURRENCY, INPUT_LEN, OUTPUT_LEN, KILL_AT = 64, 8, 64, 64, 1.0


def test_decode_killed_under_load_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """decode-0 SIGKILLed 1 s into 64 requests at concurrency 8: every request is counted
    once, the undisturbed run fails none, the supervisor restarts decode with a new pid,
    the figures agree with each other and no KV page is in use afterwards."""
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(model), "--device", "cpu", "--kill", "decode-0"]
    argv += ["--concurrency", str(CONCURRENCY), "--num-requests", str(NUM)]
    argv += ["--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
    argv += ["--kill-at", str(KILL_AT)]
    assert faults.main(argv) == 0
    table = capsys.readouterr().out
    assert "Fault Benchmark Result" in table and "SIGKILL decode-0" in table
    r = json.loads((out / "faults.json").read_text())

    u, f = r["undisturbed"], r["faulted"]
    for run in (u, f):
        assert run["requests"] == NUM
        assert run["ok"] + run["failed"] == NUM
        assert run["output_tokens"] == run["ok"] * OUTPUT_LEN  # EOS ignored: all asked for
    assert u["failed"] == 0
    assert isinstance(r["migrated"], int) and r["migrated"] >= 0
    if r["migration_metric"]:  # a gateway that migrates loses nothing to a decode's death
        assert f["failed"] == 0
    else:
        assert r["migrated"] == 0
    for name in ("ttft_ms", "e2e_ms"):
        for q in ("p50", "p99"):
            if f["ok"]:
                assert r["ratios"][f"{name}_{q}"] == pytest.approx(f[name][q] / u[name][q])
            else:  # no latency without a request that succeeded: null, not a number
                assert r["ratios"][f"{name}_{q}"] is None and f[name][q] is None
        assert u[name]["p50"] <= u[name]["p99"]

    kill = r["kill"]
    assert kill["service"] == "decode-0"
    assert kill["at_s"] >= KILL_AT - 1e-3  # the event loop's timer, against perf_counter
    assert kill["restart_s"] > 0
    assert kill["restart_delay_s"] == RestartPolicy().backoff_initial_s
    assert kill["restart_healthy"] is True
    assert kill["new_pid"] not in (None, kill["pid"])
    assert kill["first_start_s"] > 0
    bound_met = f["e2e_ms"]["p99"] <= r["e2e_p99_bound_ms"] if f["ok"] else None
    assert r["e2e_p99_within_bound"] == bound_met
    assert r["e2e_p99_bound_ms"] == pytest.approx(
        1.5 * u["e2e_ms"]["p99"] + kill["restart_s"] * 1e3
    )

    # with one decode, a request sent after the kill is served only once decode is back
    assert r["serving_again_s"] > 0
    assert sum(f["failures"].values()) == f["failed"]
    assert (f["last_failure_s"] is None) == (f["failed"] == 0)

    rec = r["recovery"]
    assert rec["reference_tok_s"] == pytest.approx(u["output_tokens"] / u["duration_s"])
    assert (rec["window_s"], rec["fraction"]) == (1.0, 0.9)
    after_kill = f["duration_s"] - kill["at_s"]
    assert rec["recovered_after_s"] is None or 0 <= rec["recovered_after_s"] <= after_kill
    assert len(r["timeline_tok_s"]["faulted"]) == math.ceil(f["duration_s"])

    assert r["kv_pages_used_after"] == 0
    assert r["instance_pages_used_after"] == {"prefill-0": 0, "decode-0": 0}
    assert r["pages_free_after_s"] is not None
    assert len(r["errors"]) == min(f["failed"], 5) + (f["failed"] > 5)
    assert (out / "logs" / "up.log").exists() and (out / "logs" / "decode-0.log").exists()


# ---- flags ----------------------------------------------------------------------------------


def config(*argv: str) -> faults.FaultBenchConfig:
    return faults.config_from(faults.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
        (["--num-requests", "-3"], "--num-requests must be at least 1, got -3"),
        (["--input-len", "0"], "--input-len must be at least 1"),
        (["--output-len", "0"], "--output-len must be at least 1"),
        (["--warmup", "-1"], "--warmup must not be negative"),
        (["--kill-at", "0"], "--kill-at must be a positive number of seconds, got 0.0"),
        (["--kill-at", "nan"], "--kill-at must be a positive number of seconds"),
        (["--window", "-1"], "--window must be a positive number of seconds"),
        (["--settle-timeout", "inf"], "--settle-timeout must be a positive number"),
        (["--recovered-fraction", "1.5"], "--recovered-fraction must be in (0, 1], got 1.5"),
        (["--recovered-fraction", "0"], "--recovered-fraction must be in (0, 1]"),
        (["--max-token-id", "3"], "--max-token-id must be above 3"),
        (["--kill", "gateway"], "--kill gateway: the gateway is excluded"),
        (["--kill", "decode"], "--kill 'decode' is not a process of a --target pd mesh"),
        (["--kill", "unified-0"], "--kill 'unified-0' is not a process of a --target pd mesh"),
        (
            ["--target", "unified"],  # the default --kill decode-0
            "--kill 'decode-0' is not a process of a --target unified mesh",
        ),
        (
            ["--target", "unified", "--kill", "unified-0", "--up-args", "--prefill 1"],
            "--target unified sets --prefill 0 --decode 0: not in --up-args",
        ),
        (["--up-args", '--dtype "bfloat16'], "--up-args: No closing quotation"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as info:
        config(*argv)
    assert message in str(info.value)
    assert faults.main(argv) == 2
    assert message in capsys.readouterr().err


def test_every_field_is_a_flag_defaulting_to_the_field() -> None:
    """The flags come from the config's fields (dsmesh/options/fields.py): no flag, no
    field, and no default, that is not declared once there."""
    flags = {f.flag for f in option_fields(faults.FaultBenchConfig)}
    assert {f.name for f in dataclasses.fields(faults.FaultBenchConfig)} == {
        f.name for f in option_fields(faults.FaultBenchConfig)
    }
    assert {"--kill-at", "--up-args", "--settle-timeout", "--max-token-id"} <= flags
    assert config() == faults.FaultBenchConfig()
    assert config("--kill", "kv_broker", "--window", "0.5").window_s == 0.5


def test_flags_build_the_mesh_users_run() -> None:
    assert config().mesh_args() == []
    assert config("--kill", "kv_broker").kill == "kv-broker"
    tuned = "--dtype bfloat16 --max-running-requests 256"
    c = config("--device", "cuda", "--kill", "prefill-0", "--up-args", tuned)
    assert c.mesh_args() == ["--device", "cuda", "--dtype", "bfloat16"] + [
        "--max-running-requests",
        "256",
    ]
    unified = config("--target", "unified", "--kill", "unified-0")
    assert unified.mesh_args() == ["--prefill", "0", "--decode", "0", "--unified", "1"]
    two = config("--target", "unified", "--kill", "unified-1", "--up-args", "--unified 2")
    assert two.mesh_args() == ["--prefill", "0", "--decode", "0", "--unified", "2"]


# ---- figures --------------------------------------------------------------------------------


def test_supervisor_lines_are_read_as_dsmesh_up_prints_them() -> None:
    """Lines as ``dsmesh up`` printed them in a run of this benchmark."""
    ready = "  decode-0     ready at 127.0.0.1:45669       pid 13465      2.5s"
    assert parse_supervisor_line(ready) == SupervisorLine("ready", "decode-0", 13465, 2.5)
    broker = "  kv-broker    ready at 127.0.0.1:40001       pid 13001      1.25s"
    assert parse_supervisor_line(broker) == SupervisorLine("ready", "kv-broker", 13001, 1.25)
    exited = (
        "dsmesh up [01:28:19]: decode-0 exited with code -9 after 7.0s; restarting in 0.5s "
        "(log: /tmp/out/logs/decode-0.log)"
    )
    assert parse_supervisor_line(exited) == SupervisorLine("exit", "decode-0", seconds=0.5)
    restarted = "dsmesh up [01:28:21]: decode-0 restarted at 127.0.0.1:44113 (pid 13692), healthy"
    assert parse_supervisor_line(restarted) == SupervisorLine("restart", "decode-0", 13692)
    slow = restarted.replace("healthy", "NOT healthy yet")
    assert parse_supervisor_line(slow) == SupervisorLine(
        "restart", "decode-0", 13692, healthy=False
    )
    assert parse_supervisor_line("           decode-0     http://127.0.0.1:1/metrics") is None


def record(
    times: list[float], success: bool = True, send_s: float = 0.0, error: str = "UNAVAILABLE"
) -> RequestRecord:
    """A request sent at ``send_s`` whose messages, one token each, arrived at ``times``."""
    return RequestRecord(
        index=0,
        max_new_tokens=len(times),
        prompt_tokens=1,
        output_tokens=len(times),
        success=success,
        error="" if success else error,
        finish_reason="length" if success else "",
        request_id="",
        send_s=send_s,
        ttft_s=times[0] - send_s if times else None,
        e2e_s=(times[-1] if times else send_s) - send_s,
        itl_s=(),
        chunk_times_s=tuple(times),
        chunk_tokens=(1,) * len(times),
    )


def steady(start: float, end: float) -> list[float]:
    """100 tokens/s from ``start`` to ``end``, each token in the middle of its 10 ms."""
    return [start + 0.005 + i * 0.01 for i in range(round((end - start) * 100))]


def test_recovery_is_the_first_window_after_the_kill_back_at_the_fraction() -> None:
    """100 tok/s for 2 s, nothing for 2 s (the kill at 2 s), 100 tok/s for 4 s; a request
    that failed at the kill still counts its tokens."""
    records = [record(steady(0, 1)), record(steady(1, 2), success=False), record(steady(4, 8))]
    got = recovery(records, kill_s=2.0, end_s=8.0, reference_tok_s=100, window_s=1, fraction=0.95)
    assert got.recovered_after_s == pytest.approx(2.0)  # the window [4, 5)
    assert got.lowest_fraction == 0.0
    # at 90% the window [3.9, 4.9) holds 90 tokens: enough
    got = recovery(records, kill_s=2.0, end_s=8.0, reference_tok_s=100, window_s=1, fraction=0.9)
    assert got.recovered_after_s == pytest.approx(1.9)
    # no dip: the window at the kill is already full
    got = recovery(records, kill_s=5.0, end_s=8.0, reference_tok_s=100, window_s=1, fraction=0.9)
    assert (got.recovered_after_s, got.lowest_fraction) == (0.0, 1.0)
    # the run ended before the rate came back, or less than a window after the kill
    assert recovery(records[:2], 2.0, 3.5, 100, 1, 0.9).recovered_after_s is None
    short = recovery(records, kill_s=7.5, end_s=8.0, reference_tok_s=100, window_s=1, fraction=0.9)
    assert short.recovered_after_s is None and math.isnan(short.lowest_fraction)


def test_timeline_and_delivered_tokens() -> None:
    records = [record(steady(0, 1)), record(steady(3, 3.5))]
    times, totals = delivered_tokens(records)
    assert len(times) == 150 and totals[-1] == 150 and times == sorted(times)
    assert timeline(records, 3.5, 1.0) == [100.0, 0.0, 0.0, 100.0]  # the last: 50 in 0.5 s


def test_serving_again_and_failures() -> None:
    """The first request sent after the kill that succeeded, and failures by cause."""
    records = [
        record([0.5, 2.5], send_s=0.1),  # sent before the kill: not a sign of serving
        record([], success=False, send_s=2.1, error="UNAVAILABLE: decode: Socket closed"),
        record([4.5, 4.6], send_s=3.0),  # its first token 2.5 s after the kill
        record([3.9], send_s=3.5),  # served sooner, though sent later
        record([], success=False, send_s=2.2, error="UNAVAILABLE: decode: Stream removed"),
        record([], success=False, send_s=2.3, error="DEADLINE_EXCEEDED: Deadline Exceeded"),
    ]
    assert first_served_after(records, kill_s=2.0) == pytest.approx(1.9)
    assert first_served_after(records, kill_s=3.6) is None
    assert failures(records) == {
        "UNAVAILABLE: decode": 2,
        "DEADLINE_EXCEEDED: Deadline Exceeded": 1,
    }
