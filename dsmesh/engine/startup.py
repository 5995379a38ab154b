"""Where an engine process's start-up goes: seconds per phase, in order.

An instance that restarts after a crash serves again only after every phase, so each is
measured and reported (the instance's ``ready`` log line, the ``dsmesh_startup_seconds``
gauge; docs/RELIABILITY.md, Restart time). The phases an engine measures itself: ``weights``
(checkpoint to device), ``kv_pool`` (sizing and allocating the pool), ``kernels`` (kernel
and attention backend choice, JIT warm-ups), ``graphs`` (decode graphs captured before
ready), ``speculative`` (the MTP draft, with ``speculative``); the instance adds
``imports`` (process start to the engine's build) and what follows the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupClock:
    """Seconds of each start-up phase, in the order first timed. One thread times phases
    at a time; any thread may read :attr:`phases`."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added to it when timed before)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        # a new dict, never one changed in place: a metrics scrape may read it meanwhile
        self.phases = {**self.phases, name: self.phases.get(name, 0.0) + seconds}

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> str:
        """``imports 2.4 s, weights 5.4 s, ...``: the phases in order, tenths of a second."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())


def process_age_s() -> float:
    """Seconds since this process started (its exec, as the kernel counts it: interpreter
    start-up and imports included), or since it was told to go on when it waited as a spare
    (:func:`count_from_now`). Linux; elsewhere the time since this module was imported."""
    return max(0.0, _age_s() - _uncounted_s)


def count_from_now() -> float:
    """Count this process's start-up from now on (:func:`process_age_s`): a spare process
    (``--standby``) that is told to go on did its imports and its waiting before the failure
    it answers. Returns the seconds left out."""
    global _uncounted_s
    _uncounted_s = _age_s()
    return _uncounted_s


def _age_s() -> float:
    try:
        with open("/proc/self/stat") as f:
            # field 22, after the command name in parentheses (which may hold spaces)
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


_IMPORTED = time.perf_counter()
_uncounted_s = 0.0  # a spare's life before it was told to go on (count_from_now)
