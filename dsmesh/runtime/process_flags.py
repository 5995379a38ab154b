"""Settings of a whole process that an engine command takes as flags, not options of any
config: Python's thread switch interval (``--gil-switch-ms``), and ``--standby`` (start as a
spare: imported, then waiting to be told to go on)."""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)

# Python's 5 ms switch interval let the event loop (64 gRPC streams) hold the GIL while the
# engine thread waited to launch the next step: measured on one H200 (unified instance,
# V2-Lite, 64 streams), 0.5 ms gave 2.4x the output tokens/s and half the TPOT.
GIL_SWITCH_MS = 0.5


def add_gil_switch_arg(g: argparse._ArgumentGroup, not_given: bool = False) -> None:
    """``--gil-switch-ms``: a setting of the process (:func:`apply_process_flags`), not of
    any config."""
    g.add_argument(
        "--gil-switch-ms",
        type=float,
        default=None if not_given else GIL_SWITCH_MS,
        metavar="MS",
        help="Python's thread switch interval in this process, i.e. how long the engine "
        "thread may wait for the GIL while the gRPC thread streams (default "
        f"{GIL_SWITCH_MS}; Python's own is 5: 2.4x less throughput for a unified instance "
        "at 64 streams on an H200, docs/BENCHMARKS.md)",
    )


def add_standby_arg(g: argparse._ArgumentGroup) -> None:
    """``--standby``: a setting of the process (:func:`apply_process_flags`)."""
    g.add_argument(
        "--standby",
        action="store_true",
        dest="wait_as_standby",  # not `standby`: `dsmesh up --standby` is the mesh's option
        help="start as a spare: import everything, then wait for a line on standard input "
        "before building the engine (`dsmesh up --standby` keeps one such process per engine "
        "instance and lets it go on when the instance dies, so a restart skips its imports; "
        "end of input: exit)",
    )


def apply_process_flags(args: argparse.Namespace) -> None:
    """Process-wide settings an engine command takes, applied once at start-up (after the
    command's imports, before it runs)."""
    switch_ms = getattr(args, "gil_switch_ms", None)
    if switch_ms is not None:
        if not switch_ms > 0:
            raise ValueError(f"--gil-switch-ms must be positive, got {switch_ms}")
        sys.setswitchinterval(switch_ms / 1000)
    if getattr(args, "wait_as_standby", False):
        wait_as_standby()


def wait_as_standby() -> None:
    """Block until a line arrives on standard input (end of input: exit with 0, whoever
    kept this spare is gone); the process's start-up is then counted from that moment."""
    from dsmesh.engine.startup import count_from_now, process_age_s

    imported = process_age_s()
    if not sys.stdin.readline():
        raise SystemExit(0)
    before = count_from_now()
    log.info("standby: imported in %.1f s, told to go on %.1f s later", imported, before - imported)
