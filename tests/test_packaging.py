"""dsmesh installs as one import package, ``dsmesh``, and shadows nobody's.

Hugging Face's ``kernels`` package (which transformers imports) and any user module named
``engine`` or ``bench`` must stay reachable beside dsmesh: a wheel built from the repository
holds exactly one top-level package, and the repository root, which ``python -m pytest`` puts
on ``sys.path``, holds no importable folder other than ``dsmesh`` and the test tree.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_TOP_LEVEL = (
    "engine",
    "kernels",
    "bench",
    "gateway",
    "prefill_svc",
    "decode_svc",
    "kv_broker",
    "eplb_svc",
    "unified_svc",
)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240
    )


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("dsmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"dsmesh"}, sorted(top)
    for sub in ("engine", "kernels", "gateway", "prefill_svc", "decode_svc", "bench"):
        assert f"dsmesh/{sub}/__init__.py" in names


def test_the_repository_root_shadows_no_package() -> None:
    importable = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() or p.suffix == ".py"
    }
    assert importable <= {"dsmesh", "tests", "protos"}, sorted(importable)


def ours(origin: Path) -> bool:
    """Whether ``origin`` is a file of the repository's own tree: inside it, and not in a
    virtual environment made there (``.venv/lib/.../site-packages``), which holds other
    projects' packages such as Hugging Face's ``kernels``."""
    return origin.is_relative_to(ROOT) and "site-packages" not in origin.relative_to(ROOT).parts


def test_old_top_level_names_are_not_ours(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys\n"
        f"for name in {OLD_TOP_LEVEL!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    origin = spec.origin if spec else None\n"
        "    print(name, origin)\n"
    )
    for cwd in (ROOT, tmp_path):
        proc = _python(code, cwd)
        assert proc.returncode == 0, proc.stderr
        for line in proc.stdout.splitlines():
            name, origin = line.split(" ", 1)
            assert not ours(Path(origin)), f"{name} resolves to the repository: {origin}"


def test_transformers_deepseek_imports_beside_dsmesh(tmp_path: Path) -> None:
    """transformers 5 imports Hugging Face's ``kernels``; from the repository root (as under
    ``python -m pytest``) and from another folder it must get that package, not dsmesh's."""
    code = (
        "import kernels, dsmesh.kernels.mla_decode\n"
        "from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM\n"
        "from dsmesh.engine.model.tiny_model import make_tiny_model\n"
        "print(kernels.__file__)\n"
    )
    for cwd in (ROOT, tmp_path):
        proc = _python(code, cwd)
        assert proc.returncode == 0, proc.stderr
        assert "site-packages" in proc.stdout, proc.stdout
