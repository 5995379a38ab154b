"""Dispatch/combine: how routed tokens reach their physical experts and come back.

The MoE layer only talks to a :class:`MoEDispatcher`. With one rank, :class:`LocalDispatcher`
sorts (token, expert) pairs by expert and nothing moves; expert-parallel backends (all-to-all
over torch.distributed, DeepEP) implement the same contract across ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from dsmesh.kernels._triton import use_triton


@dataclass
class DispatchOutput:
    """What a rank's local experts must process.

    hidden: [N, hidden] tokens received, grouped by local expert (expert 0's first); may be
        a view with a row stride larger than ``hidden`` (rows of a receive buffer).
    tokens_per_expert: [num_local_experts] int64, sums to N.
    handle: backend state that ``combine`` needs; opaque to the caller.
    expert_ids: when set ([N] int64), the rows are not grouped: row i is for local expert
        ``expert_ids[i]``, -1 marking padding (its output row is never read), and
        ``tokens_per_expert`` is None (fixed-shape dispatch, dsmesh/engine/ep/all_to_all.py).
    """

    hidden: torch.Tensor
    tokens_per_expert: torch.Tensor | None
    handle: object
    expert_ids: torch.Tensor | None = None


class Pending:
    """An operation in flight; ``wait()`` returns its result (once)."""

    def __init__(self, finish) -> None:
        self._finish = finish

    def wait(self):
        return self._finish()


class MoEDispatcher(ABC):
    """Contract: ``combine(f(dispatch(x, ids, w).hidden), handle)[t] == sum_k w[t,k] *
    f_{ids[t,k]}(x[t])`` for every token ``t`` of this rank, where ``f_e`` is physical expert
    ``e``. Every rank of the group must call both, in the same order, even with zero tokens.
    The dispatcher owns the returned tensors until ``combine`` returns.

    ``capturable``: dispatch and combine never synchronise with the host (their shapes are
    known on the host without reading the routing), so a CUDA graph can capture them.
    """

    capturable: bool = False
    static: bool = False  # the fixed-shape mode, set around captured forwards
    # dsmesh's Triton kernels for the dispatcher's own packing and combining, else the torch
    # references; set once with the model's KernelChoice (DeepseekMoE.set_kernels)
    triton: bool = False

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchOutput:
        """hidden [T, H]; physical_ids [T, k] int64; weights [T, k] float32."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """expert_out [N, H] (rows as in ``dispatched.hidden``) -> [T, H] weighted sums."""

    def dispatch_start(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> Pending:
        """Start ``dispatch``; ``wait()`` gives its DispatchOutput. Backends with asynchronous
        communication override this so that compute can run while tokens travel (two-batch
        overlap); the default does the work at once."""
        out = self.dispatch(hidden, physical_ids, weights)
        return Pending(lambda: out)

    def combine_start(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> Pending:
        """Start ``combine``; ``wait()`` gives the [T, H] result."""
        out = self.combine(expert_out, dispatched)
        return Pending(lambda: out)


@dataclass
class _LocalHandle:
    order: torch.Tensor  # [T*k] flat (token, slot) index of each dispatched row
    weights: torch.Tensor  # [T, k] float32, as routed
    num_tokens: int
    top_k: int


class LocalDispatcher(MoEDispatcher):
    """Single rank: every physical expert is local; physical id = local expert index."""

    capturable = True

    def __init__(self, num_local_experts: int) -> None:
        self.num_local_experts = num_local_experts

    def dispatch(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchOutput:
        top_k = physical_ids.shape[1]
        flat_ids = physical_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        # scatter_add_, not bincount: its size is known, so no host sync (CUDA graphs)
        counts = torch.zeros(self.num_local_experts, dtype=torch.int64, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        rows = hidden.index_select(0, order // top_k)
        handle = _LocalHandle(order, weights, hidden.shape[0], top_k)
        return DispatchOutput(rows, counts, handle)

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h = dispatched.handle
        assert isinstance(h, _LocalHandle)
        if use_triton(expert_out):
            # One gather-and-sum pass per token (float32, one rounding; no atomics). The
            # CPU path below sums with index_add_, the engine's exact reference order.
            from dsmesh.kernels.moe_gemm import unpermute_combine

            return unpermute_combine(expert_out, h.order, h.weights)
        out = torch.zeros(
            (h.num_tokens, expert_out.shape[1]), dtype=expert_out.dtype, device=expert_out.device
        )
        weighted = expert_out * h.weights.reshape(-1)[h.order][:, None].to(expert_out.dtype)
        out.index_add_(0, h.order // h.top_k, weighted)
        return out


@contextlib.contextmanager
def static_mode(dispatchers: Iterable[MoEDispatcher]) -> Iterator[None]:
    """``dispatchers`` (each once) in their fixed-shape mode for the forwards inside: what a
    CUDA graph captures. Under expert parallelism every rank of the group must run such a
    forward in the same step (the collectives pair up by shape)."""
    unique = list({id(d): d for d in dispatchers}.values())
    for d in unique:
        d.static = True
    try:
        yield
    finally:
        for d in unique:
            d.static = False
