"""What an eplb process is told at start-up: each field is a flag of ``dsmesh eplb serve``
(dsmesh/options/fields.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.runtime.server_options import ServerOptions, metrics_port_option, port_option

DEFAULT_PORT = 50055  # the CLI's default; EPLBConfig's 0 picks any free port


@dataclass(frozen=True)
class EPLBConfig(ServerOptions):
    port: int = port_option(DEFAULT_PORT)  # 0: any free port (reported through ``ready``)
    interval_s: float = option(
        60.0,
        "periodic rebalance of every instance with load",
        parse=argtypes.seconds,
        metavar="SECONDS",
        up="--eplb-interval",
    )
    threshold: float = option(
        0.05,
        "apply a placement when it raises predicted balancedness (mean/max per-rank load) "
        "by more than this",
        parse=argtypes.below_one,
        up="--eplb-threshold",
    )
    window_steps: int = option(
        1000, "engine steps of load kept per instance", parse=argtypes.positive, metavar="N"
    )
    metrics_port: int = metrics_port_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        if not (math.isfinite(self.threshold) and 0 <= self.threshold < 1):
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold}")
        if self.window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {self.window_steps}")
