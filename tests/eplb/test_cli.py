"""``dsmesh eplb serve|dump|simulate`` as real processes: the simulator reproduces the
controller's figures for the dumped load."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from dsmesh.cli.main import main
from dsmesh.engine.ep.load_recorder import ExpertLoadRecorder
from dsmesh.eplb_svc.algorithm import balancedness, predicted_rank_load, rebalance_experts
from dsmesh.eplb_svc.convert import report_from_sample
from dsmesh.v1 import eplb_pb2 as pb
from dsmesh.v1 import eplb_pb2_grpc
from tests.eplb.conftest import SHAPE, sample, skewed_counts, trivial_placement

pytestmark = pytest.mark.timeout(120)


def dsmesh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "dsmesh", *args], capture_output=True, text=True, timeout=60
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.fixture
def eplb_proc():
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsmesh", "eplb", "serve", "--port", "0", "--interval", "3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "eplb did not start"
        line = proc.stdout.readline()
        assert line.startswith("eplb listening on 127.0.0.1:"), line
        yield line.split()[-1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


def in_process(capsys: pytest.CaptureFixture[str], *args: str, code: int = 0) -> str:
    """The same CLI entry point, without a new interpreter (faster); stdout, or stderr when
    it fails."""
    capsys.readouterr()
    assert main(list(args)) == code
    out = capsys.readouterr()
    return out.out if code == 0 else out.err


def test_dump_then_simulate_reproduces_the_controller(
    eplb_proc: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loads = [skewed_counts(seed) for seed in (5, 6)]
    with grpc.insecure_channel(eplb_proc) as chan:
        stub = eplb_pb2_grpc.EPLBStub(chan)
        reports = [report_from_sample(sample(load, trivial_placement())) for load in loads]
        stub.ReportLoad(iter(reports), timeout=10)
        decision = stub.Rebalance(pb.RebalanceRequest(dry_run=True), timeout=10).skipped[0]

    out = tmp_path / "load.json"
    dsmesh("eplb", "dump", "--eplb", eplb_proc, "--out", str(out))
    record = json.loads(out.read_text())
    window = loads[0] + loads[1]
    assert record["tokens_per_logical_expert"] == window.tolist()
    assert record["window_steps"] == 20 and record["ep_size"] == SHAPE.ep_size
    assert record["physical_to_logical"] == trivial_placement().tolist()

    redundant = str(SHAPE.num_physical - SHAPE.num_logical)
    args = ["eplb", "simulate", "--load", str(out), "--ep-size", "4"]
    sim = json.loads(dsmesh(*args, "--num-redundant-experts", redundant, "--json").stdout)
    assert sim["overall"]["recorded"] == decision.balancedness_before
    assert sim["overall"]["eplb"] == decision.balancedness_after
    eplb = rebalance_experts(window, SHAPE.num_physical, 1, 1, 4)[0]
    assert sim["overall"]["eplb"] == balancedness(predicted_rank_load(window, eplb, 4))
    assert sim["overall"]["trivial"] == sim["overall"]["recorded"]  # recorded = round robin
    assert len(sim["per_layer"]["eplb"]) == SHAPE.num_moe_layers

    png = tmp_path / "heat.png"
    table = in_process(capsys, *args, "--num-redundant-experts", redundant, "--plot", str(png))
    lines = table.splitlines()
    assert lines[1].split() == ["layer", "recorded", "trivial", "eplb"]
    overall = lines[-2].split()
    assert overall[0] == "overall" and float(overall[3]) == round(sim["overall"]["eplb"], 3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_reads_a_recorder_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = ExpertLoadRecorder(num_moe_layers=2, num_physical=8)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        rec.record(0, torch.randint(0, 3, (16, 2), generator=g))  # experts 0-2 hot
        rec.record(1, torch.randint(0, 8, (16, 2), generator=g))
        rec.end_step()
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec.export()))
    args = ["eplb", "simulate", "--load", str(path), "--ep-size", "4", "--json"]
    sim = json.loads(in_process(capsys, *args, "--num-redundant-experts", "4"))
    logical = rec.window()
    want = rebalance_experts(logical, 12, 1, 1, 4)[0]
    assert sim["overall"]["eplb"] == balancedness(predicted_rank_load(logical, want, 4))
    assert sim["overall"]["eplb"] > sim["overall"]["trivial"]

    # physical != logical and nothing to map them: refused, naming the field
    data = rec.export() | {"num_logical_experts": 6}
    path.write_text(json.dumps(data))
    assert "tokens_per_logical_expert" in in_process(capsys, *args, code=2)
    path.write_text(json.dumps(rec.export()))
    bad = dsmesh("eplb", "simulate", "--load", str(path), "--ep-size", "3", check=False)
    assert bad.returncode == 2 and "split evenly" in bad.stderr, bad.stderr
