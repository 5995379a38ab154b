"""An EP group's side of EPLB, run by every rank's step loop between forwards.

The ranks already vote once per loop iteration (``GroupVote``); this hook adds four numbers
to that vote, so it needs no collective of its own on an ordinary iteration. Rank 0 sets two,
so every rank learns at the same iteration that:
- a new placement arrived (its version): rank 0 broadcasts it and every rank stages it in the
  background (``Rebalancer.submit``);
- a load report is due: every rank hands over the load it recorded since the last report,
  summed over the group onto rank 0, which queues it for eplb_svc.

The other two carry the highest and lowest version the ranks have staged: when they agree,
all ranks swap in that same iteration (``Rebalancer.swap_if_agreed``). Load recorded under
the old placement is flushed just before a swap, so each report names the placement its
tokens were routed under.

Rank 0's gRPC side (``EPLBLink``) talks to this object only through :meth:`offer_placement`
and :meth:`pop_report`, both thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsmesh.engine.ep.load_recorder import ExpertLoadRecorder
from dsmesh.engine.ep.rebalance import Rebalancer, StagedPlacement
from dsmesh.engine.model.deepseek import DeepseekForCausalLM


@dataclass(frozen=True)
class GroupReport:
    """Load since the previous report, summed over the group's ranks."""

    physical_counts: torch.Tensor  # [L, P] int64
    num_steps: int
    physical_to_logical: torch.Tensor  # [L, P] the placement the tokens were routed under
    applied_version: int
    last_swap_seconds: float


_CEILING = 1 << 62  # MAX over (_CEILING - v) gives the minimum of v


class GroupEPLB:
    # [new placement version, report due, highest staged version, _CEILING - lowest staged]
    NUM_FLAGS = 4

    def __init__(
        self,
        model: DeepseekForCausalLM,
        checkpoint_dir: str | Path,
        report_interval_s: float = 1.0,
        window_steps: int = 1000,
    ) -> None:
        self.model = model
        self.rank = model.ep_rank
        loc = model.expert_location
        self.recorder = ExpertLoadRecorder(
            loc.physical_to_logical.shape[0],
            loc.num_physical,
            window_steps,
            device=model.lm_head.weight.device,
        )
        for moe in model.moe_layers():
            moe.load_recorder = self.recorder
        self.rebalancer = Rebalancer(model, checkpoint_dir)
        self.report_interval_s = report_interval_s
        self.swaps = 0
        self._device = model.lm_head.weight.device
        self._lock = threading.Lock()
        self._offered: tuple[int, torch.Tensor] | None = None  # rank 0: newest from eplb_svc
        self._submitted = 0
        self._reports: deque[GroupReport] = deque(maxlen=64)
        self._last_report = time.monotonic()
        self._staged: StagedPlacement | None = None  # this rank's offer in this iteration's vote

    # ---- rank 0, any thread ------------------------------------------------------------------

    def offer_placement(self, version: int, physical_to_logical: torch.Tensor) -> None:
        with self._lock:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, physical_to_logical.to(torch.int64).cpu())

    def pop_report(self) -> GroupReport | None:
        with self._lock:
            return self._reports.popleft() if self._reports else None

    def pending_reports(self) -> int:
        with self._lock:
            return len(self._reports)

    # ---- every rank, the step loop -------------------------------------------------------------

    def vote_flags(self) -> list[int]:
        self._staged = self.rebalancer.offer()  # swapped in below if every rank offers it
        ready = 0 if self._staged is None else self._staged.version
        if self.rank != 0:
            return [0, 0, ready, _CEILING - ready]
        with self._lock:
            offered = self._offered[0] if self._offered is not None else 0
        due = time.monotonic() - self._last_report >= self.report_interval_s
        return [offered if offered > self._submitted else 0, int(due), ready, _CEILING - ready]

    def after_vote(self, flags: list[int]) -> None:
        """Collective: all ranks call it with the same (group-reduced) flags."""
        version, due, high, low_complement = flags
        if version > self._submitted:
            self._receive_placement(version)
        if due:
            self._report()
        staged, self._staged = self._staged, None
        low = _CEILING - low_complement
        if self.rebalancer.swap_if_agreed(staged, low, high, before_swap=self._report):
            self.swaps += 1

    def after_step(self) -> None:
        self.recorder.end_step()

    def close(self) -> None:
        self.rebalancer.close()

    def _receive_placement(self, version: int) -> None:
        shape = self.model.expert_location.physical_to_logical.shape
        if self.rank == 0:
            with self._lock:
                assert self._offered is not None
                p2l = self._offered[1].to(self._device)
        else:
            p2l = torch.empty(shape, dtype=torch.int64, device=self._device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(p2l, src=0)
        self._submitted = version
        self.rebalancer.submit(version, p2l.cpu())

    def _report(self) -> None:
        counts, steps = self.recorder.take()
        counts = counts.to(self._device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        self._last_report = time.monotonic()
        if self.rank != 0 or steps == 0:
            return
        report = GroupReport(
            counts.cpu(),
            steps,
            self.model.expert_location.physical_to_logical.clone(),
            self.rebalancer.applied_version,
            self.rebalancer.last_swap_seconds,
        )
        with self._lock:
            self._reports.append(report)
