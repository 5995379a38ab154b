"""The kustomize targets render. Always: the YAML-level renderer (tests/deploy/manifests.py)
builds every overlay (resources exist, patches hit existing objects, no duplicates). With a
``kustomize`` or ``kubectl`` binary on PATH: the real build succeeds and makes exactly the
objects the YAML-level renderer makes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import K8S, OVERLAYS, RenderError, key_of, render

TARGETS = [*OVERLAYS, K8S / "base"]


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def test_there_are_overlays() -> None:
    assert {p.name for p in OVERLAYS} >= {"seed-ep32-ep72", "single-node"}


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_yaml_level_render(target: Path) -> None:
    objects = render(target)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "LeaderWorkerSet", "PodDisruptionBudget"} <= kinds
    assert all(
        o["metadata"].get("namespace") == "dsmesh" for o in objects if o["kind"] != "Namespace"
    )


def test_yaml_level_renderer_refuses_a_patch_without_target(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{(K8S / 'base').as_posix()}]\npatches:\n  - path: p.yaml\n"
    )
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n")
    with pytest.raises(RenderError, match="matches no object"):
        render(tmp_path)


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_kustomize_renders_the_same_objects(target: Path) -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize or kubectl binary on PATH (the YAML-level render still runs)")
    proc = subprocess.run([*command, str(target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    real = sorted((d for d in yaml.safe_load_all(proc.stdout) if d), key=key_of)
    assert real == sorted(render(target), key=key_of)
