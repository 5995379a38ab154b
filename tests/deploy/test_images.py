"""The images' entry points exist: ENTRYPOINT is the ``dsmesh`` console script that
pyproject.toml declares, every COPY source is in the build context (the repository root),
every package pyproject installs is copied, the extras installed exist, and the healthcheck
module the compose file calls runs."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.manifests import DEPLOY, ROOT, load_compose

DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped;
    heredoc bodies (RUN <<'PY' ... PY) are skipped."""
    out: list[tuple[str, str]] = []
    lines = iter(path.read_text().splitlines())
    pending = ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest))
        heredoc = re.search(r"<<-?'?(\w+)'?", rest)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        pending = ""
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_the_dsmesh_console_script(dockerfile: Path) -> None:
    entry = [json.loads(a) for i, a in instructions(dockerfile) if i == "ENTRYPOINT"]
    assert entry[-1:] == [["dsmesh"]]
    target = PYPROJECT["project"]["scripts"]["dsmesh"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_the_console_script_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsmesh", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("dsmesh "), proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_cover_every_package(dockerfile: Path) -> None:
    copied = set()
    for instruction, args in instructions(dockerfile):
        if instruction != "COPY":
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: not in the context"
            copied.add(src.rstrip("/"))
    assert {"pyproject.toml", "README.md"} <= copied  # README: pyproject's readme
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert package in copied, f"{dockerfile.name} does not copy package {package}"
    ignore = Path(f"{dockerfile}.dockerignore")
    assert ignore.is_file(), f"{ignore.name}: BuildKit's per-Dockerfile ignore file"
    allowed = {
        line[1:].rstrip("/") for line in ignore.read_text().splitlines() if line.startswith("!")
    }
    hidden = {c for c in copied if not any(c == a or c.startswith(f"{a}/") for a in allowed)}
    assert not hidden, f"{ignore.name} hides {hidden}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installed_extras_exist(dockerfile: Path) -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    text = dockerfile.read_text()
    found = re.findall(r"\.\[([\w,-]+)\]", text)
    assert found or "scripts/setup-gpu.sh" in text, dockerfile.name
    for group in found:
        for extra in group.split(","):
            assert extra in extras, f"{dockerfile.name}: no extra [{extra}] in pyproject.toml"


def test_gpu_image_has_the_gpu_stack() -> None:
    """The GPU image installs through scripts/setup-gpu.sh, as a bare-metal host does, and
    pins no library of its own: the versions live in dsmesh/kernels/libraries.py."""
    dockerfile = DEPLOY / "Dockerfile"
    text = dockerfile.read_text()
    for needle in ("flashinfer-python", "DeepGEMM", "DeepEP", "libibverbs"):
        assert needle in text, needle
    runs = [args for instruction, args in instructions(dockerfile) if instruction == "RUN"]
    assert "bash scripts/setup-gpu.sh --libraries-only" in runs
    assert any(r.startswith("bash scripts/setup-gpu.sh --no-editable") for r in runs)
    pins = r"(flashinfer-python|sgl-deep-gemm|sgl-deep-ep|mooncake-transfer-engine[\w-]*|triton)=="
    assert not re.search(pins, text), "pin versions in dsmesh/kernels/libraries.py"
    # DeepGEMM and DeepEP may fail to build without failing the image
    for name in ("DeepGEMM", "DeepEP"):
        assert re.search(rf"\|\| echo \"WARNING: {name} did not (build|install)", text), name


def test_compose_builds_its_images_from_these_dockerfiles() -> None:
    built = {
        svc["build"]["dockerfile"] for svc in load_compose()["services"].values() if "build" in svc
    }
    assert built == {"deploy/Dockerfile", "deploy/Dockerfile.cpu"}
    for svc in load_compose()["services"].values():
        if "build" in svc:
            context = (DEPLOY / svc["build"]["context"]).resolve()
            assert context == ROOT
            assert (context / svc["build"]["dockerfile"]).is_file()


def test_healthcheck_names_an_unreachable_target() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsmesh.cli.healthcheck", "--timeout", "1", "127.0.0.1:1", "nohost"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "127.0.0.1:1: UNAVAILABLE" in proc.stderr
    assert "nohost: expected HOST:PORT or an http(s):// URL" in proc.stderr
