"""The start-up clock (dsmesh/engine/startup.py) and the phases an engine records on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.startup import StartupClock


def test_phases_keep_their_order_and_add_up() -> None:
    clock = StartupClock()
    clock.add("imports", 2.3)
    clock.add("weights", 5.0)
    clock.add("imports", 0.1)  # timed again: added to its first place
    with clock.phase("graphs"):
        pass
    assert list(clock.phases) == ["imports", "weights", "graphs"]
    assert clock.phases["imports"] == pytest.approx(2.4)
    assert clock.total == pytest.approx(7.4 + clock.phases["graphs"])
    assert clock.summary().startswith("imports 2.4 s, weights 5.0 s, graphs 0.0 s")


def test_a_failed_phase_is_still_timed() -> None:
    clock = StartupClock()
    with pytest.raises(RuntimeError), clock.phase("weights"):
        raise RuntimeError("bad checkpoint")
    assert list(clock.phases) == ["weights"]


def test_process_age_counts_from_the_process_start() -> None:
    code = """
        import time
        time.sleep(0.5)  # before the module is imported: only the process start counts it
        from dsmesh.engine.startup import process_age_s
        print(process_age_s())
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) >= 0.5


def test_engine_records_its_phases_on_the_given_clock() -> None:
    clock = StartupClock()
    clock.add("imports", 1.0)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32"), startup=clock)
    assert engine.startup is clock
    # on CPU there are no graphs to capture, but the phase is still reported (0 s or so)
    assert list(clock.phases) == ["imports", "weights", "kv_pool", "kernels", "graphs"]
    assert clock.phases["imports"] == 1.0 and clock.phases["weights"] > 0
