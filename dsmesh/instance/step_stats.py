"""Where an engine's time goes, summarised every few seconds into one log line.

Each step is classed by what it ran, read from its outputs: *decode* (every row fed one
token), *prefill* (prompt chunks only) or *mixed* (prompt chunks riding along with decode
rows, as a unified instance runs them). Pure: the caller passes the clock and the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dsmesh.engine.llm_engine import StepOutput

KINDS = ("decode", "mixed", "prefill")


@dataclass
class _Kind:
    steps: int = 0
    seconds: float = 0.0
    rows: int = 0  # decode rows
    prompt_tokens: int = 0


@dataclass
class StepStats:
    """Accumulates steps; :meth:`report` returns a line and starts a new period once
    ``interval_s`` has passed (None before that, or when nothing ran)."""

    interval_s: float = 10.0
    started: float | None = None
    kinds: dict[str, _Kind] = field(default_factory=lambda: {k: _Kind() for k in KINDS})
    tokens_out: int = 0

    def add(self, seconds: float, outputs: Sequence[StepOutput], now: float) -> None:
        if self.started is None:
            self.started = now - seconds
        rows = prompt = 0
        for out in outputs:
            start, end = out.computed
            if end - start == 1 and out.new_token_ids:
                rows += 1
            else:
                prompt += end - start
            self.tokens_out += len(out.new_token_ids)
        if not outputs:
            return
        kind = "decode" if not prompt else ("mixed" if rows else "prefill")
        k = self.kinds[kind]
        k.steps += 1
        k.seconds += seconds
        k.rows += rows
        k.prompt_tokens += prompt

    def report(self, now: float) -> str | None:
        if self.started is None or now - self.started < self.interval_s:
            return None
        period = now - self.started
        parts = []
        for name, k in self.kinds.items():
            if not k.steps:
                continue
            text = f"{name} {k.steps} x {k.seconds / k.steps * 1e3:.1f} ms"
            if k.rows:
                text += f", {k.rows / k.steps:.1f} rows"
            if k.prompt_tokens:
                text += f", {k.prompt_tokens / k.steps:.0f} prompt tokens"
            parts.append(text)
        busy = sum(k.seconds for k in self.kinds.values())
        prompt = sum(k.prompt_tokens for k in self.kinds.values())
        line = (
            f"engine: {period:.1f} s, busy {busy / period:.0%}: {'; '.join(parts) or 'idle'}; "
            f"{self.tokens_out / period:.0f} tokens/s out, {prompt / period:.0f} prompt tokens/s"
        )
        self.started = None
        self.kinds = {k: _Kind() for k in KINDS}
        self.tokens_out = 0
        return line
