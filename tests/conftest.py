"""Suite-wide set-up that must happen before any test module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU, tests/kernels runs the Triton kernels in Triton's CPU interpreter. The
    # choice is read when triton is first imported, and transformers imports it, so it is
    # made here, before any test module loads. The engine never runs Triton on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``slow`` every test that tests/slow_tests.py lists (measured durations)."""
    import pytest

    from tests.slow_tests import is_slow

    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
