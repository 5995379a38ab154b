"""What ``scripts/setup-gpu.sh`` installs on a GPU host, for the torch already there.

:func:`plan` is a pure function from (torch version, CUDA version, Python version) to the pip
requirements, each with why, and the libraries skipped, each with why: dsmesh itself
(editable), Triton, the Mooncake transfer engine built for torch's CUDA, FlashInfer at the
tested release, DeepGEMM and DeepEP at the release built for that torch
(:mod:`dsmesh.kernels.libraries`). torch is never installed or upgraded: the installed
release is passed to pip as a constraint (``torch==<installed>``), so a requirement that
would need another torch fails the install instead of replacing it.

``python -m dsmesh.runtime.gpu_install [--dry-run] [-- PIP_ARGS...]`` reads torch's versions,
prints the plan and the pip command, and runs it (not with ``--dry-run``). With
``--dry-run`` only, ``DSMESH_TORCH_VERSION`` and ``DSMESH_CUDA_VERSION`` (empty: a CPU build)
stand in for the installed torch, so the plan for any host can be printed anywhere.
Standard library only: it runs before dsmesh is installed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from dsmesh.kernels import libraries as lib

__all__ = ["GpuInstallError", "InstallPlan", "Requirement", "main", "pip_command", "plan"]

# The Mooncake Transfer Engine build for each CUDA major (pyproject's transfer-gpu extras)
MOONCAKE = {
    13: ("mooncake-transfer-engine-cuda13>=0.3.14", "the CUDA 13 build (CUDA IPC between GPUs "
         "of one host, RDMA across hosts; tested with 0.3.14)"),
    12: ("mooncake-transfer-engine>=0.3.13", "the CUDA 12 build"),
}  # fmt: skip
TORCH_ENV = "DSMESH_TORCH_VERSION"
CUDA_ENV = "DSMESH_CUDA_VERSION"


class GpuInstallError(ValueError):
    """This environment cannot take dsmesh's GPU install; the message says what to do."""


@dataclass(frozen=True)
class Requirement:
    """One pip requirement (``spec`` as pip takes it) and why it is installed."""

    spec: str
    why: str


@dataclass(frozen=True)
class InstallPlan:
    """``requirements`` in pip's order; ``skipped``: one line per library left out;
    ``constraint``: the line that keeps the installed torch (``torch==<version>``)."""

    torch_version: str
    cuda_version: str
    constraint: str
    requirements: tuple[Requirement, ...]
    skipped: tuple[str, ...]

    def describe(self) -> list[str]:
        """The lines the installer prints: the torch it keeps, each requirement, each skip."""
        width = max(len(r.spec) for r in self.requirements)
        lines = [f"  keep  {self.constraint:<{width}}  the installed torch (a pip constraint)"]
        lines += [f"  add   {r.spec:<{width}}  {r.why}" for r in self.requirements]
        lines += [f"  skip  {line}" for line in self.skipped]
        return lines


def plan(
    torch_version: str,
    cuda_version: str | None,
    python: tuple[int, int] = (3, 12),
    torch_dist_version: str | None = None,
    dsmesh: str | None = "-e .",
) -> InstallPlan:
    """The GPU install for torch ``torch_version`` (``torch.__version__``) built for CUDA
    ``cuda_version`` (``torch.version.cuda``; None for a CPU build) under CPython ``python``.
    ``torch_dist_version`` is the version pip sees installed (PyPI's CUDA wheels say
    "2.11.0" where torch says "2.11.0+cu130"); it defaults to ``torch_version``.
    ``dsmesh``: how dsmesh itself is installed: ``-e .`` (a checkout), ``.`` (an image that
    drops the source) or None (the libraries only).

    Raises :class:`GpuInstallError` for a CPU (or ROCm) torch or a CUDA other than 12/13."""
    if not cuda_version:
        raise GpuInstallError(
            f"torch {torch_version} is not a CUDA build (torch.version.cuda is None): install a "
            "CUDA build of torch first (PyPI's Linux wheels are CUDA builds), then rerun; on a "
            "CPU machine run bash scripts/setup-cpu.sh instead"
        )
    lib.torch_release(torch_version)  # a clear error for a malformed version
    cuda_major = int(cuda_version.split(".")[0])
    if cuda_major not in MOONCAKE:
        raise GpuInstallError(
            f"torch {torch_version} is built for CUDA {cuda_version}; dsmesh's GPU install "
            f"covers CUDA {' and '.join(str(m) for m in sorted(MOONCAKE))}: install a torch "
            "built for one of them"
        )
    mooncake, mooncake_why = MOONCAKE[cuda_major]
    reqs = [] if dsmesh is None else [Requirement(dsmesh, "dsmesh itself and its dependencies")]
    reqs += [
        Requirement("triton", "dsmesh's own kernels; the release this torch requires"),
        Requirement(mooncake, f"KV transfer: {mooncake_why}"),
        Requirement(
            f"{lib.FLASHINFER_DIST}=={lib.FLASHINFER_TESTED}",
            "MLA decode attention, the release dsmesh's adapter was tested with (compiles "
            "its kernels on this machine: fits any CUDA torch; pulls apache-tvm-ffi)",
        ),
    ]
    skipped = []
    for label, module, builds in (
        ("DeepGEMM", "deep_gemm", lib.DEEP_GEMM_BUILDS),
        ("DeepEP", "deep_ep", lib.DEEP_EP_BUILDS),
    ):
        build = lib.build_for(builds, torch_version, cuda_version)
        if build is None:
            skipped.append(
                f"{label}: no {builds[0].distribution} build for torch {torch_version} "
                f"(CUDA {cuda_version}); builds exist for {lib.builds_summary(builds)}"
            )
        elif module == "deep_ep" and not _in(python, lib.DEEP_EP_PYTHONS):
            low, high = lib.DEEP_EP_PYTHONS
            skipped.append(
                f"{label}: {build.distribution} {build.install} has wheels for CPython "
                f"{low[0]}.{low[1]}-{high[0]}.{high[1]}, this is {python[0]}.{python[1]}"
            )
        else:
            tested = "tested by dsmesh" if build.tested else "not yet run by dsmesh's GPU tests"
            what = (
                "FP8 grouped GEMM for prefill-sized expert batches"
                if module == "deep_gemm"
                else "MoE dispatch/combine for expert parallelism (--moe-dispatch)"
            )
            reqs.append(
                Requirement(
                    f"{build.distribution}=={build.install}",
                    f"{label}: {what}; built for torch {build.torch} + CUDA "
                    f"{build.cuda_major} ({tested})",
                )
            )
    dist_version = torch_dist_version or torch_version
    return InstallPlan(
        torch_version, cuda_version, f"torch=={dist_version}", tuple(reqs), tuple(skipped)
    )


def _in(python: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= python <= bounds[1]


def pip_command(
    install: InstallPlan, constraints_file: str, pip_args: Sequence[str] = ()
) -> list[str]:
    """``python -m pip install -c CONSTRAINTS <requirements> <pip_args>``; ``-e .`` is two
    arguments."""
    cmd = [sys.executable, "-m", "pip", "install", "-c", constraints_file]
    for req in install.requirements:
        cmd += req.spec.split(" ", 1) if req.spec.startswith("-e ") else [req.spec]
    return cmd + list(pip_args)


def _installed_torch(dry_run: bool) -> tuple[str, str | None, str]:
    """(torch.__version__, torch.version.cuda, pip's version of torch); the environment's
    stand-ins only under ``dry_run``."""
    fake = os.environ.get(TORCH_ENV)
    if fake is not None:
        if not dry_run:
            raise GpuInstallError(f"{TORCH_ENV} / {CUDA_ENV} are read with --dry-run only")
        return fake, os.environ.get(CUDA_ENV) or None, fake
    try:
        import torch
    except ImportError as exc:
        raise GpuInstallError(
            f"torch is not installed for {sys.executable}: dsmesh keeps the torch a GPU host "
            "already has and never installs one. Install the CUDA build of torch first "
            "(PyPI's Linux wheels are CUDA builds: pip install torch), then rerun"
        ) from exc
    from importlib import metadata

    return torch.__version__, torch.version.cuda, metadata.version("torch")


def report() -> list[str]:
    """One line per optional library as dsmesh will see it at start-up (after installing)."""
    return [
        f"  {module:<10} {'ok  ' if st.usable else 'NOT '} {st.detail}"
        for module in ("flashinfer", "deep_gemm", "deep_ep")
        for st in [lib.status(module)]
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/setup-gpu.sh",
        description="Install dsmesh and its GPU libraries for the CUDA torch already "
        "installed (never installs or upgrades torch).",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the pip command only")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--no-editable", action="store_true", help="install dsmesh as a copy, not editable"
    )
    what.add_argument(
        "--libraries-only", action="store_true", help="install the GPU libraries, not dsmesh"
    )
    parser.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("pip_args", nargs="*", help="after --: extra arguments for pip")
    args = parser.parse_args(argv)
    if args.report:
        print("\n".join(["dsmesh GPU libraries:", *report()]))
        return 0
    try:
        version, cuda, dist_version = _installed_torch(args.dry_run)
        python = sys.version_info[:2]
        dsmesh = None if args.libraries_only else "." if args.no_editable else "-e ."
        install = plan(version, cuda, python, dist_version, dsmesh)
    except GpuInstallError as exc:
        print(f"setup-gpu: {exc}", file=sys.stderr)
        return 2
    print(f"dsmesh GPU set-up for torch {version} (CUDA {cuda}), Python {python[0]}.{python[1]}:")
    print("\n".join(install.describe()))
    with tempfile.TemporaryDirectory(prefix="dsmesh-setup-gpu-") as tmp:
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as f:
            f.write(install.constraint + "\n")
        cmd = pip_command(install, constraints, args.pip_args)
        print(f"pip command ({constraints} holds {install.constraint}):\n  {shlex.join(cmd)}")
        if args.dry_run:
            return 0
        done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        print(f"setup-gpu: pip failed ({done.returncode}); torch is as it was", file=sys.stderr)
        return done.returncode
    # a fresh process reads the metadata of what pip just installed
    cmd = [sys.executable, "-m", "dsmesh.runtime.gpu_install", "--report"]
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
