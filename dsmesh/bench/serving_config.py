"""One serving benchmark run's config (:class:`BenchConfig`), which the runner (serving.py)
and the report (serving_report.py) both read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; ``dsmesh bench`` maps its flags onto this in one place."""

    backend: str = "grpc"  # one of backends.BACKENDS
    grpc_addr: str = "127.0.0.1:50051"
    url: str = "http://127.0.0.1:8000"  # REST base URL
    request_rate: float = math.inf  # requests/s of the Poisson arrivals; inf = all at once
    max_concurrency: int | None = None  # requests in flight at most (client-side semaphore)
    warmup: int = 1  # requests sent before timing, not counted
    warmup_concurrency: int = 1  # warm-up requests in flight at once
    seed: int = 0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # deadline of each request
    # offline backend: the engine's config (dsmesh.engine.llm_engine.EngineConfig; None = defaults,
    # the tiny model), so the in-process baseline runs the same engine the mesh runs
    engine: Any = None

    @property
    def target(self) -> str:
        if self.backend == "offline":
            model = getattr(self.engine, "model", None)
            return f"offline engine ({model or 'tiny default model'})"
        if self.backend == "openai":
            return f"{self.url}/v1/completions"
        return self.grpc_addr if self.backend == "grpc" else self.url
