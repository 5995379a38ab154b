"""dsmesh/bench/no_max_tokens.py: the CPU smoke variant through a real ``dsmesh up`` (tiny shape, a
short context, a KV pool too small for every request at once), and its pure parts."""

from __future__ import annotations

import json
from pathlib import Path

from dsmesh.bench import no_max_tokens
from dsmesh.bench.checkpoint import shape_config

CONTEXT, INPUT_LEN = 384, 128


def test_checkpoint_declares_the_context_asked_for() -> None:
    assert shape_config("tiny")["max_position_embeddings"] == 163840
    assert shape_config("tiny", max_position_embeddings=2048)["max_position_embeddings"] == 2048


def test_cpu_smoke_runs_every_request_without_max_tokens(tmp_path: Path) -> None:
    """Six requests of 128 prompt tokens with no max_tokens, against a pool of 1024 tokens
    (64 pages; six full contexts need 144): none fails, none sent max_tokens, each ran to the
    context limit or to EOS, and the unified instance reserved nothing ahead."""
    argv = ["--out", str(tmp_path / "out"), "--model-dir", str(tmp_path / "model")]
    argv += ["--shape", "tiny", "--device", "cpu", "--context", str(CONTEXT)]
    argv += ["--input-len", str(INPUT_LEN), "--num-prompts", "6", "--concurrency", "6"]
    argv += ["--max-total-tokens", "1024", "--sample-s", "0.2"]
    report = no_max_tokens.run(no_max_tokens.parse_args(argv))["unified"]
    assert no_max_tokens.passed(report)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["max_position_embeddings"] == CONTEXT
    assert (report["requests"], report["ok"], report["failed"]) == (6, 6, 0)
    assert report["sent_max_tokens"] == 0
    records = json.loads((tmp_path / "out" / "unified" / "bench.json").read_text())["requests"]
    for r in records:
        assert r["max_new_tokens"] is None and r["prompt_tokens"] == INPUT_LEN
        if r["finish_reason"] == "length":  # the gateway's default: up to the context limit
            assert r["prompt_tokens"] + r["output_tokens"] == CONTEXT
        else:
            assert r["finish_reason"] == "stop"  # EOS, honoured
    assert report["reached_context_limit"] + report["ended_by_eos"] == 6
    assert report["reached_context_limit"] >= 1
    assert not report["reserved_up_front"]
    unified = report["instances"]["unified-0"]
    assert unified["kv_reserved_ahead_tokens_total"] == 0
    assert unified["total_pages"] == 1024 // 16
    assert 0 < unified["peak_pages_used"] <= unified["total_pages"]


def test_up_front_reservation_is_judged_per_role() -> None:
    ok = {"prefill-0": {"kv_reserved_ahead_tokens_total": 8.0}}
    ok["decode-0"] = {"kv_reserved_ahead_tokens_total": 0.0}
    assert not no_max_tokens.reserved_up_front(ok, num_requests=8)
    assert no_max_tokens.reserved_up_front(ok, num_requests=7)  # more than one token each
    bad = {"unified-0": {"kv_reserved_ahead_tokens_total": 1.0}}
    assert no_max_tokens.reserved_up_front(bad, num_requests=8)


def test_up_flags_size_the_pool_below_concurrency_times_context() -> None:
    args = no_max_tokens.parse_args(["--device", "cuda"])
    assert args.kinds == ["unified"]
    flags = no_max_tokens.up_flags(args, "unified", 9100)
    pool = int(flags[flags.index("--max-total-tokens") + 1])
    assert pool == 256 * 2048 // 2 < args.concurrency * args.context
    assert flags[flags.index("--max-running-requests") + 1] == "256"
    assert flags[flags.index("--instance-metrics-port") + 1] == "9100"
    assert flags[-6:] == ["--prefill", "0", "--decode", "0", "--unified", "1"]
    args = no_max_tokens.parse_args(["--kinds", "unified,pd"])
    assert args.kinds == ["unified", "pd"]
    assert "--unified" not in no_max_tokens.up_flags(args, "pd", 9100)
