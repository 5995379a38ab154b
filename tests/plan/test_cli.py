"""``dsmesh plan`` end to end, as a user runs it: a subprocess of the console entry point."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dsmesh", "plan", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip


def test_one_node_plan_prints_a_table_and_a_runnable_up_command() -> None:
    out = plan(
        "--model", "v2-lite", "--gpu", "h200", "--gpus", "1", "--input-len", "1000",
        "--output-len", "128", "--ttft-p90", "2000", "--itl-p90", "50",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "| 1 | unified 1 x EP1 |" in out.stdout
    assert "binding" in out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("run the best: ")]
    words = shlex.split(line.removeprefix("run the best: "))
    assert words[:4] == ["dsmesh", "up", "--model", "/models/DeepSeek-V2-Lite"]
    assert words[words.index("--unified") + 1] == "1"
    # the command parses as `dsmesh up`'s own flags
    from dsmesh.cli.main import build_parser

    args = build_parser().parse_args(words[1:])
    assert args.unified == 1 and args.max_running_requests >= 1


def test_seed_scale_plan_writes_a_kustomize_overlay(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    png = tmp_path / "plans.png"
    out = plan(
        "--gpus", "96", "--input-len", "2000", "--output-len", "1000", "--ttft-p90", "5000",
        "--itl-p90", "100", "--k8s-overlay", str(overlay), "--plot", str(png), "--top", "3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [x for x in out.stdout.splitlines() if x.startswith("| ") and x[2].isdigit()]
    assert len(rows) == 3 and all(" P " in r or "unified" in r for r in rows)
    assert "Kubernetes overlay" in out.stdout
    kust = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../../base"]
    configs = list(yaml.safe_load_all((overlay / "ep-config.yaml").read_text()))
    assert {c["metadata"]["name"] for c in configs} == {"prefill-config", "decode-config"}
    eps = [int(c["data"]["EP_SIZE"]) for c in configs]
    sizes = [p["patch"] for p in kust["patches"][1:]]
    assert all("/spec/leaderWorkerTemplate/size" in s for s in sizes) and sum(eps) <= 96
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_and_questions() -> None:
    out = plan("--validate")
    assert out.returncode == 0, out.stderr
    assert "V3, H100, decode EP72, 256/GPU, 2K" in out.stdout and "**miss**" not in out.stdout
    out = plan("--questions")
    assert out.returncode == 0, out.stderr
    assert "GB200" in out.stdout and "TP16 x 6" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "no-such-model"), "--model"),
        (("--gpu", "spec"), "--gpu-spec"),
        (("--gpu", "spec", "--gpu-spec", "1,2,3"), "--gpu-spec"),
        (("--gpus", "0"), "--gpus"),
        (("--mtp-acceptance", "1.5"), "--mtp-acceptance"),
        (("--input-len", "9,3"), "--input-len"),
        (("--concurrency", "-4"), "--concurrency"),
        (("--concurrency", "0"), "--concurrency"),
        (("--concurrency", "many"), "--concurrency"),
        (("--rate", "2", "--concurrency", "8"), "--concurrency"),
        (("--rate", "-1"), "--rate"),
    ],
)
def test_bad_input_names_the_flag(args: tuple[str, ...], message: str) -> None:
    out = plan(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_unmeetable_targets_say_so() -> None:
    out = plan("--model", "v2-lite", "--gpu", "h200", "--gpus", "1", "--itl-p90", "0.5")
    assert out.returncode == 1
    assert "no deployment meets the targets" in out.stdout


def test_help_does_not_import_the_model() -> None:
    code = (
        "import sys; from dsmesh.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('dsmesh.plan')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_overlay_renders_over_the_base(tmp_path: Path) -> None:
    """The overlay `dsmesh plan` writes builds over deploy/k8s/base (the repository's
    kustomize renderer) into EP groups whose sizes are nodes x GPUs per pod, whose experts
    divide, and whose containers parse as dsmesh commands."""
    from dsmesh.cli.main import build_parser
    from tests.deploy.manifests import dsmesh_containers, render

    (tmp_path / "k8s" / "overlays").mkdir(parents=True)
    (tmp_path / "k8s" / "base").symlink_to(ROOT / "deploy" / "k8s" / "base")
    overlay = tmp_path / "k8s" / "overlays" / "planned"
    out = plan("--gpus", "96", "--k8s-overlay", str(overlay))
    assert out.returncode == 0, out.stderr
    objects = render(overlay)
    lws = {o["metadata"]["name"]: o for o in objects if o["kind"] == "LeaderWorkerSet"}
    roles = set()
    for c in dsmesh_containers(objects):
        if not c.where.startswith("LeaderWorkerSet/"):
            continue
        args = build_parser().parse_args(c.argv)
        group = lws[c.where.split("/", 1)[1]]["spec"]
        gpus = int(c.spec["resources"]["limits"]["nvidia.com/gpu"])
        assert args.ep_size == group["leaderWorkerTemplate"]["size"] * gpus, c.where
        assert (256 + args.num_redundant_experts) % args.ep_size == 0, c.where
        roles.add(c.argv[0])
    assert roles == {"prefill", "decode"}


def test_concurrency_scores_plans_in_a_closed_loop() -> None:
    """64 clients on one H200: the plans are scored at what 64 clients get, with TTFT and
    ITL p50 / p90 / p99, and the best comes with its `dsmesh up` command."""
    out = plan(
        "--model", "v2-lite", "--gpu", "h200", "--gpus", "1", "--input-len", "1000",
        "--output-len", "128", "--concurrency", "64", "--ttft-p90", "2000", "--itl-p90", "50",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "a closed loop of 64 clients" in out.stdout
    assert "TTFT p50 / p90 / p99 ms" in out.stdout and "ITL p50 / p90 / p99 ms" in out.stdout
    row = next(x for x in out.stdout.splitlines() if x.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ttft = [float(v.replace(",", "")) for v in cells[10].split(" / ")]
    itl = [float(v) for v in cells[11].split(" / ")]
    assert ttft == sorted(ttft) and itl == sorted(itl) and itl[1] <= 50
    assert cells[-1] == "concurrency 64"
    assert any(x.startswith("run the best: dsmesh up") for x in out.stdout.splitlines())


def test_help_shows_a_concurrency_example() -> None:
    out = plan("--help")
    assert out.returncode == 0
    assert "--concurrency 64" in out.stdout and "--concurrency N" in out.stdout
