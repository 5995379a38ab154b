"""How a speculating engine drafts: the speculative worker's own configuration, derived
from the engine's options (dsmesh/engine/speculative/worker.py, ``make_speculator``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a speculating engine drafts."""

    num_draft_tokens: int = 1  # K: tokens drafted per step, verified in one target forward
    # Decode batches larger than this run without speculation (plain steps, CUDA graphs):
    # verifying K + 1 positions per request stops paying once the batch is compute-bound.
    max_batch: int = 64
    # BENCHMARK ONLY: accept each draft of a greedy request with this probability (the chain
    # stops at the first rejection) whatever the models say, emitting the target's tokens:
    # random weights accept nothing, and this simulates a real MTP's acceptance. Output is
    # not the model's greedy output. None = real verification.
    forced_acceptance: float | None = None
    attention_mode: str = "auto"
    page_size: int = 16
    # the target's forwards as two micro-batches (EngineConfig.tbo); the MTP layer's draft
    # forwards run as one batch
    tbo: bool = False
