"""Per-request sampling parameters, shared by the engine, the services and the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError

INT32_MAX = 2**31 - 1  # the wire format's int32 fields


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k. ``seed`` makes a sampled
    request reproducible whatever else shares its batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first invalid field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0, got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1), got {self.min_p}")
        if not 1 <= self.max_new_tokens <= INT32_MAX:
            raise InvalidRequestError(
                "max_new_tokens", f"must be in [1, 2**31 - 1], got {self.max_new_tokens}"
            )
        if self.top_k > INT32_MAX:
            raise InvalidRequestError("top_k", f"must be at most 2**31 - 1, got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids", f"must be in [0, 2**31 - 1], got {list(self.stop_token_ids)}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
