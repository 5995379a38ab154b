"""How long prefill expects a request to take, from rates it measures as it works.

kv_broker keeps a handoff's deadline ahead of this estimate (docs/PD.md, "Deadlines"), so a
deadline follows the work in front of a request (prompt tokens to compute, KV bytes to
write) instead of a fixed number of seconds. Pure: callers pass the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


class RateMeter:
    """An exponentially weighted rate (units per second) of work measured in pieces.

    ``observe(units, seconds)`` adds a piece; :attr:`rate` is 0.0 until the first piece.
    ``weight`` is how much a new piece counts (1.0: only the last one).
    """

    def __init__(self, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.rate = 0.0

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        sample = units / seconds
        self.rate = sample if self.rate == 0.0 else self.rate + self.weight * (sample - self.rate)


class StepRate:
    """Prompt tokens per second of the engine's forwards, measured between consecutive steps.

    Engine thread: :meth:`add` the tokens each step output computed, with the step's index
    and the time its outputs are delivered; the time between two consecutive deliveries is
    one forward. A step after an idle gap is not timed (its start is unknown).
    """

    def __init__(self, meter: RateMeter | None = None) -> None:
        self.meter = meter or RateMeter()
        self._step = -1
        self._tokens = 0
        self._at = 0.0
        self._prev_at: float | None = None

    def add(self, step: int, tokens: int, now: float) -> None:
        if step != self._step:
            consecutive = step == self._step + 1
            if self._prev_at is not None and self._tokens:
                self.meter.observe(self._tokens, self._at - self._prev_at)
            self._prev_at = self._at if consecutive else None
            self._step, self._tokens, self._at = step, 0, now
        self._tokens += tokens

    @property
    def rate(self) -> float:
        return self.meter.rate


@dataclass(frozen=True)
class Backlog:
    """Work in front of (and including) one request: prompt tokens still to compute and KV
    bytes still to write, with the rates they go at (0 = not measured yet)."""

    tokens: int
    token_rate: float
    bytes: int
    byte_rate: float

    def seconds(self) -> float:
        """Expected time to get through it; parts whose rate is unknown count 0."""
        compute = self.tokens / self.token_rate if self.token_rate > 0 else 0.0
        write = self.bytes / self.byte_rate if self.byte_rate > 0 else 0.0
        return compute + write
