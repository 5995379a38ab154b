"""Settings of a whole process that an engine command takes as flags, not options of any
config: Python's thread switch interval (``--gil-switch-ms``)."""

from __future__ import annotations

import argparse
import sys

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


def apply_process_flags(args: argparse.Namespace) -> None:
    """Process-wide settings an engine command takes, applied once at start-up."""
    switch_ms = getattr(args, "gil_switch_ms", None)
    if switch_ms is not None:
        if not switch_ms > 0:
            raise ValueError(f"--gil-switch-ms must be positive, got {switch_ms}")
        sys.setswitchinterval(switch_ms / 1000)
