"""scripts/setup-gpu.sh and its plan (dsmesh/runtime/gpu_install.py): what a GPU host gets
for the torch it has, torch kept by a constraint, the refusals, and the script's dry run with
a stand-in torch version (nothing is installed here)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dsmesh.kernels import libraries as lib
from dsmesh.runtime import gpu_install
from dsmesh.runtime.gpu_install import GpuInstallError, plan

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _specs(torch_version: str, cuda: str | None, **kw) -> list[str]:
    return [r.spec for r in plan(torch_version, cuda, **kw).requirements]


def test_h200_torch_gets_the_tested_builds_and_no_deep_ep() -> None:
    install = plan("2.11.0+cu130", "13.0", (3, 12), torch_dist_version="2.11.0")
    assert [r.spec for r in install.requirements] == [
        "-e .",
        "triton",
        "mooncake-transfer-engine-cuda13>=0.3.14",
        "flashinfer-python==0.6.18.post1",
        "sgl-deep-gemm==0.1.5",
    ]
    assert install.constraint == "torch==2.11.0"  # pip's version of PyPI's cu130 wheel
    assert install.skipped == (
        "DeepEP: no sgl-deep-ep build for torch 2.11.0+cu130 (CUDA 13.0); builds exist for "
        "torch 2.13.0 + CUDA 13 (0.1.0-0.1.2), torch 2.14.1 + CUDA 13 (0.1.2.post1)",
    )
    why = {r.spec: r.why for r in install.requirements}
    assert why["sgl-deep-gemm==0.1.5"].endswith("built for torch 2.11 + CUDA 13 (tested by dsmesh)")


@pytest.mark.parametrize(
    ("torch_version", "cuda", "expected"),
    [
        ("2.13.0+cu130", "13.0", ["sgl-deep-gemm==0.2.1", "sgl-deep-ep==0.1.2"]),
        ("2.14.1+cu130", "13.0", ["sgl-deep-gemm==0.2.5", "sgl-deep-ep==0.1.2.post1"]),
        ("2.12.0+cu130", "13.0", []),
    ],
)
def test_binary_builds_follow_torch(torch_version, cuda, expected) -> None:
    assert _specs(torch_version, cuda)[4:] == expected


def test_cuda_12_gets_its_transfer_engine_and_skips_the_cuda_13_builds() -> None:
    install = plan("2.8.0+cu128", "12.8")
    assert [r.spec for r in install.requirements][2:] == [
        "mooncake-transfer-engine>=0.3.13",
        "flashinfer-python==0.6.18.post1",
    ]
    assert [line.split(":")[0] for line in install.skipped] == ["DeepGEMM", "DeepEP"]
    assert install.constraint == "torch==2.8.0+cu128"


def test_deep_ep_skipped_outside_its_wheels_pythons() -> None:
    install = plan("2.13.0+cu130", "13.0", (3, 14))
    assert "sgl-deep-ep==0.1.2" not in [r.spec for r in install.requirements]
    assert install.skipped == (
        "DeepEP: sgl-deep-ep 0.1.2 has wheels for CPython 3.10-3.13, this is 3.14",
    )


def test_refusals_name_what_to_do() -> None:
    with pytest.raises(GpuInstallError, match="torch 2.13.0\\+cpu is not a CUDA build"):
        plan("2.13.0+cpu", None)
    with pytest.raises(
        GpuInstallError, match="CUDA 11.8; dsmesh's GPU install covers CUDA 12 and 13"
    ):
        plan("2.4.0+cu118", "11.8")
    with pytest.raises(ValueError, match="not a torch version"):
        plan("nightly", "13.0")


def test_missing_torch_is_refused(monkeypatch) -> None:
    monkeypatch.delenv(gpu_install.TORCH_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(GpuInstallError, match="torch is not installed for .*never installs one"):
        gpu_install._installed_torch(dry_run=False)


def test_pip_command_constrains_torch_and_passes_extra_args() -> None:
    install = plan("2.11.0+cu130", "13.0", dsmesh=".")
    cmd = gpu_install.pip_command(install, "/tmp/c.txt", ["--no-index", "--find-links", "w"])
    assert cmd[:6] == [sys.executable, "-m", "pip", "install", "-c", "/tmp/c.txt"]
    assert cmd[6:8] == [".", "triton"]
    assert cmd[-3:] == ["--no-index", "--find-links", "w"]
    assert _specs("2.11.0+cu130", "13.0")[0] == "-e ."
    assert gpu_install.pip_command(plan("2.11.0+cu130", "13.0"), "c")[6:8] == ["-e", "."]
    libraries = gpu_install.pip_command(plan("2.11.0+cu130", "13.0", dsmesh=None), "c")
    assert libraries[6:] == [
        "triton",
        "mooncake-transfer-engine-cuda13>=0.3.14",
        "flashinfer-python==0.6.18.post1",
        "sgl-deep-gemm==0.1.5",
    ]


def test_pyproject_extras_carry_the_same_pins() -> None:
    """One source of truth: the extras a user may install by hand pin what the script does."""
    cuda13, cuda12 = gpu_install.MOONCAKE[13][0], gpu_install.MOONCAKE[12][0]
    flashinfer = f"{lib.FLASHINFER_DIST}=={lib.FLASHINFER_TESTED}"
    assert EXTRAS["gpu"] == ["triton>=3.0", flashinfer, cuda13]
    assert EXTRAS["flashinfer"] == [flashinfer]
    assert EXTRAS["transfer-gpu"] == [cuda13]
    assert EXTRAS["transfer-gpu-cu12"] == [cuda12]
    tested = next(b for b in lib.DEEP_GEMM_BUILDS if b.tested)
    assert EXTRAS["deepgemm"] == [f"{tested.distribution}=={tested.install}"]


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSMESH_")}
    environ.update(env, PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup-gpu.sh"), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )


def test_script_dry_run_prints_the_plan_and_the_pip_command() -> None:
    proc = _script(
        "--dry-run",
        "--",
        "--no-index",
        DSMESH_TORCH_VERSION="2.11.0+cu130",
        DSMESH_CUDA_VERSION="13.0",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(
        line.startswith("dsmesh GPU set-up for torch 2.11.0+cu130 (CUDA 13.0)") for line in lines
    )
    assert any(line.split()[:2] == ["keep", "torch==2.11.0+cu130"] for line in lines)
    assert any(line.split()[:2] == ["add", "sgl-deep-gemm==0.1.5"] for line in lines)
    assert any(line.startswith("  skip  DeepEP: no sgl-deep-ep build") for line in lines)
    pip = lines[lines.index(next(x for x in lines if x.startswith("pip command"))) + 1].split()
    assert pip[1:5] == ["-m", "pip", "install", "-c"]
    assert pip[6:] == [
        "-e", ".", "triton", "'mooncake-transfer-engine-cuda13>=0.3.14'",
        "flashinfer-python==0.6.18.post1", "sgl-deep-gemm==0.1.5", "--no-index",
    ]  # fmt: skip


def test_script_refuses_a_cpu_torch_and_stand_ins_outside_dry_run() -> None:
    cpu = _script("--dry-run", DSMESH_TORCH_VERSION="2.13.0+cpu", DSMESH_CUDA_VERSION="")
    assert cpu.returncode == 2
    assert "setup-gpu: torch 2.13.0+cpu is not a CUDA build" in cpu.stderr
    assert "bash scripts/setup-cpu.sh" in cpu.stderr
    real = _script(DSMESH_TORCH_VERSION="2.11.0+cu130", DSMESH_CUDA_VERSION="13.0")
    assert real.returncode == 2
    assert "DSMESH_TORCH_VERSION / DSMESH_CUDA_VERSION are read with --dry-run only" in real.stderr
