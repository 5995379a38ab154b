"""The fast tier (``python -m pytest -m "not slow"``) reaches every package of dsmesh, and
tests/slow_tests.py names only tests that exist.

A package counts as reached when a test file left in the fast tier imports it
(``dsmesh.<package>`` or ``from dsmesh import <package>``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slow_tests import SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "dsmesh").iterdir() if (p / "__init__.py").is_file())


def _collect(*marker: str) -> list[str]:
    """Node ids ``pytest --collect-only`` lists (quiet through the addopts), with ``-m``
    ``marker`` when given."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider"]
    if marker:
        args += ["-m", *marker]
    out = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def fast_tests() -> list[str]:
    return _collect("not slow")


def _imports(text: str, package: str) -> bool:
    return bool(
        re.search(rf"\bdsmesh\.{package}\b", text)
        or re.search(rf"^from dsmesh import [^\n]*\b{package}\b", text, re.MULTILINE)
    )


def test_every_package_has_a_fast_test(fast_tests: list[str]) -> None:
    files = {node.split("::")[0] for node in fast_tests}
    texts = {f: (ROOT / f).read_text() for f in files}
    unreached = [p for p in PACKAGES if not any(_imports(t, p) for t in texts.values())]
    assert unreached == [], f"no test outside the slow list imports dsmesh.{unreached}"
    assert len(PACKAGES) >= 10  # the walk found dsmesh's packages


def test_the_slow_list_names_existing_tests() -> None:
    stale = []
    for node in SLOW:
        path, _, name = node.partition("::")
        file = ROOT / path
        function = name.split("::")[-1].split("[")[0]
        if not file.is_file() or (
            function and not re.search(rf"^\s*(?:async )?def {function}\(", file.read_text(), re.M)
        ):
            stale.append(node)
    assert stale == [], f"tests/slow_tests.py names tests that no longer exist: {stale}"
    assert SLOW, "the slow list is empty: the fast tier would run the whole suite"


def test_the_fast_tier_leaves_out_the_listed_tests(fast_tests: list[str]) -> None:
    listed = [node for node in fast_tests if is_slow(node)]
    assert listed == []
    assert len(fast_tests) > 300  # the fast tier still runs most tests of the suite
