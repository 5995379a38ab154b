"""Tokens routed to each physical expert, per MoE layer, over a sliding window of steps.

One recorder per rank; EPLB (docs/EPLB.md) streams its windows to eplb_svc and turns them
into placements. Recording adds each MoE layer's routed pairs into a counter on the device
(no host sync, so CUDA graphs capture it too); closing a step copies the counters to the host.
"""

from __future__ import annotations

from collections import deque

import torch


class ExpertLoadRecorder:
    def __init__(
        self,
        num_moe_layers: int,
        num_physical: int,
        window_steps: int = 1000,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_moe_layers = num_moe_layers
        self.num_physical = num_physical
        self.window_steps = window_steps
        # this step's counts, where the routed ids live (allocated here, never in a capture)
        self._counting = torch.zeros(num_moe_layers, num_physical, dtype=torch.int64, device=device)
        self._window: deque[torch.Tensor] = deque()
        self._total = torch.zeros(num_moe_layers, num_physical, dtype=torch.int64)
        self._untaken = torch.zeros_like(self._total)  # closed steps since the last take()
        self._untaken_steps = 0

    def record(self, moe_layer: int, physical_ids: torch.Tensor) -> None:
        """physical_ids [T, k]: the physical experts this rank's tokens were sent to."""
        flat = physical_ids.reshape(-1).to(self._counting.device)
        ones = torch.ones(1, dtype=torch.int64, device=flat.device).expand_as(flat)
        self._counting[moe_layer].scatter_add_(0, flat, ones)

    def end_step(self) -> None:
        """Close the step: its counts enter the window, the oldest step leaves it."""
        current = self._counting.to("cpu", copy=True)
        self._counting.zero_()
        self._window.append(current)
        self._total += current
        self._untaken += current
        self._untaken_steps += 1
        if len(self._window) > self.window_steps:
            self._total -= self._window.popleft()

    def window(self) -> torch.Tensor:
        """[num_moe_layers, num_physical] int64 tokens over the window's steps."""
        return self._total.clone()

    def take(self) -> tuple[torch.Tensor, int]:
        """([num_moe_layers, num_physical] int64 tokens, steps) closed since the previous
        take: what an instance streams to eplb_svc. Independent of the window."""
        out, steps = self._untaken, self._untaken_steps
        self._untaken = torch.zeros_like(self._total)
        self._untaken_steps = 0
        return out, steps

    @property
    def num_steps(self) -> int:
        return len(self._window)

    def export(self) -> dict[str, object]:
        """JSON-ready window: what eplb_svc and ``dsmesh eplb dump`` consume."""
        return {
            "num_moe_layers": self.num_moe_layers,
            "num_physical_experts": self.num_physical,
            "window_steps": self.num_steps,
            "tokens_per_expert": self.window().tolist(),
        }
