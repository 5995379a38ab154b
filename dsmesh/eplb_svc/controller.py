"""The EPLB controller's policy, with no network: load samples in, versioned placements out.

Per instance it keeps a sliding window of load samples (the last ``window_steps`` engine
steps, converted to *logical* load with the placement each sample was recorded under, so the
window survives placement changes), and decides whether a new placement is worth applying:
only when its predicted balancedness beats the current placement's by more than the
threshold (or when forced). The servicer gathers inputs and publishes outputs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.eplb_svc.algorithm import (
    balancedness,
    check_shape,
    logical_load_of_physical,
    predicted_rank_load,
    rank_load_of_physical,
    rebalance_experts,
)


class InvalidLoad(InvalidRequestError):
    """A report that cannot be used; ``field`` names the offending report field."""


@dataclass(frozen=True)
class InstanceShape:
    """What an EP instance's placements look like."""

    num_moe_layers: int
    num_logical: int
    num_physical: int
    ep_size: int
    num_nodes: int = 1
    num_groups: int = 1

    def validate(self) -> None:
        for name in ("num_moe_layers", "num_logical", "num_physical", "ep_size"):
            if getattr(self, name) < 1:
                raise InvalidLoad(_FIELD[name], f"must be >= 1, got {getattr(self, name)}")
        for name in ("num_nodes", "num_groups"):
            if getattr(self, name) < 1:
                raise InvalidLoad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.num_physical < self.num_logical:
            raise InvalidLoad(
                "num_physical_experts",
                f"{self.num_physical} is less than num_logical_experts {self.num_logical}",
            )
        if self.num_physical % self.ep_size:
            raise InvalidLoad(
                "num_physical_experts",
                f"{self.num_physical} cannot be split evenly over ep_size {self.ep_size}",
            )
        nodes, groups = self.policy_nodes_groups()
        try:
            check_shape(self.num_logical, self.num_physical, groups, nodes, self.ep_size)
        except ValueError as exc:
            name = "num_nodes" if "nodes" in str(exc) else "num_groups"
            raise InvalidLoad(name, str(exc)) from None

    def policy_nodes_groups(self) -> tuple[int, int]:
        """(nodes, groups) the algorithm runs with: the global policy ignores both."""
        if self.num_groups % self.num_nodes == 0:
            return self.num_nodes, self.num_groups
        return 1, 1

    @property
    def physical_shape(self) -> tuple[int, int]:
        return (self.num_moe_layers, self.num_physical)


_FIELD = {
    "num_moe_layers": "num_moe_layers",
    "num_logical": "num_logical_experts",
    "num_physical": "num_physical_experts",
    "ep_size": "ep_size",
}


@dataclass(frozen=True)
class LoadSample:
    """An instance's load since its previous sample.

    physical_counts: [L, P] int64 tokens routed to each physical expert (all ranks summed).
    physical_to_logical: [L, P] int64, the placement those tokens were routed under.
    """

    instance_id: str
    shape: InstanceShape
    physical_counts: torch.Tensor
    num_steps: int
    physical_to_logical: torch.Tensor
    applied_version: int = 0
    last_swap_seconds: float = 0.0

    def validate(self) -> None:
        if not self.instance_id:
            raise InvalidLoad("instance_id", "must not be empty")
        self.shape.validate()
        if self.num_steps < 0:
            raise InvalidLoad("window_steps", f"must not be negative, got {self.num_steps}")
        if self.applied_version < 0:
            raise InvalidLoad("applied_version", f"must not be negative: {self.applied_version}")
        if not (math.isfinite(self.last_swap_seconds) and self.last_swap_seconds >= 0):
            raise InvalidLoad("last_swap_seconds", f"must be >= 0, got {self.last_swap_seconds}")
        check_counts(self.physical_counts, self.shape, "tokens_per_expert")
        check_placement(self.physical_to_logical, self.shape, "physical_to_logical")


def check_counts(counts: torch.Tensor, shape: InstanceShape, name: str) -> None:
    if tuple(counts.shape) != shape.physical_shape:
        raise InvalidLoad(
            name,
            f"expected num_moe_layers * num_physical_experts = "
            f"{shape.num_moe_layers * shape.num_physical} values, got {counts.numel()}",
        )
    if counts.numel() and int(counts.min()) < 0:
        raise InvalidLoad(name, "token counts must not be negative")


def check_placement(p2l: torch.Tensor, shape: InstanceShape, name: str) -> None:
    if tuple(p2l.shape) != shape.physical_shape:
        raise InvalidLoad(
            name,
            f"expected num_moe_layers * num_physical_experts = "
            f"{shape.num_moe_layers * shape.num_physical} values, got {p2l.numel()}",
        )
    if int(p2l.min()) < 0 or int(p2l.max()) >= shape.num_logical:
        raise InvalidLoad(name, f"logical expert ids must be in [0, {shape.num_logical})")
    counts = torch.zeros(shape.num_moe_layers, shape.num_logical, dtype=torch.int64)
    counts.scatter_add_(1, p2l, torch.ones_like(p2l))
    if bool((counts == 0).any()):
        layer, expert = (counts == 0).nonzero()[0].tolist()
        raise InvalidLoad(name, f"logical expert {expert} of MoE layer {layer} has no replica")


class LoadWindow:
    """The last ``window_steps`` steps of an instance's load (whole samples: the oldest
    sample leaves once the newer ones alone cover the window)."""

    def __init__(self, shape: InstanceShape, window_steps: int) -> None:
        self.shape = shape
        self.window_steps = window_steps
        self._samples: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque()

    def add(self, sample: LoadSample) -> None:
        logical = logical_load_of_physical(
            sample.physical_counts, sample.physical_to_logical, self.shape.num_logical
        ).to(torch.int64)
        self._samples.append((sample.num_steps, logical, sample.physical_counts.clone()))
        while len(self._samples) > 1 and self.num_steps - self._samples[0][0] >= self.window_steps:
            self._samples.popleft()

    @property
    def num_steps(self) -> int:
        return sum(steps for steps, _, _ in self._samples)

    def logical_load(self) -> torch.Tensor:
        """[L, N] int64 tokens per logical expert over the window."""
        out = torch.zeros(self.shape.num_moe_layers, self.shape.num_logical, dtype=torch.int64)
        for _, logical, _ in self._samples:
            out += logical
        return out

    def physical_load(self) -> torch.Tensor:
        """[L, P] int64 tokens per physical slot over the window (slots may have changed
        expert meanwhile; per-rank sums stay meaningful)."""
        out = torch.zeros(self.shape.physical_shape, dtype=torch.int64)
        for _, _, physical in self._samples:
            out += physical
        return out


@dataclass(frozen=True)
class Decision:
    """physical_to_logical [L, P] int64: the proposed placement; ``apply``: whether to."""

    physical_to_logical: torch.Tensor
    before: float
    after: float
    apply: bool

    @property
    def gain(self) -> float:
        return self.after - self.before


def decide(
    logical_load: torch.Tensor,
    current: torch.Tensor,
    shape: InstanceShape,
    threshold: float,
    force: bool = False,
) -> Decision:
    """Compute EPLB's placement for ``logical_load`` [L, N] and compare it with ``current``
    [L, P], both predicted with tokens split evenly over replicas. Apply when the gain in
    balancedness exceeds ``threshold``, or when ``force``."""
    nodes, groups = shape.policy_nodes_groups()
    proposed, _, _ = rebalance_experts(
        logical_load, shape.num_physical, groups, nodes, shape.ep_size
    )
    before = balancedness(predicted_rank_load(logical_load, current, shape.ep_size))
    after = balancedness(predicted_rank_load(logical_load, proposed, shape.ep_size))
    return Decision(proposed, before, after, force or after - before > threshold)


@dataclass
class InstanceState:
    """What the controller knows of one instance."""

    shape: InstanceShape
    window: LoadWindow
    placement: torch.Tensor  # [L, P] the latest version's (or the reported one at version 0)
    version: int = 0  # latest version pushed
    applied_version: int = 0  # latest version the instance reported running
    history: list[Decision] = field(default_factory=list)

    def measured_balancedness(self) -> float:
        return balancedness(rank_load_of_physical(self.window.physical_load(), self.shape.ep_size))


class Controller:
    """Windows and versions of every instance. Not thread-safe: one owner (the servicer's
    event loop) calls it; the heavy :func:`decide` may run elsewhere on a snapshot."""

    def __init__(self, window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.window_steps = window_steps
        self.instances: dict[str, InstanceState] = {}

    def report(self, sample: LoadSample) -> bool:
        """Add a validated sample; returns True when it announces a newly applied version."""
        sample.validate()
        state = self.instances.get(sample.instance_id)
        if state is None:
            state = InstanceState(
                sample.shape,
                LoadWindow(sample.shape, self.window_steps),
                sample.physical_to_logical.clone(),
                version=sample.applied_version,
                applied_version=sample.applied_version,
            )
            self.instances[sample.instance_id] = state
        elif state.shape != sample.shape:
            raise InvalidLoad(
                _changed_field(state.shape, sample.shape),
                f"instance {sample.instance_id!r} reported shape {sample.shape}, "
                f"earlier {state.shape}",
            )
        if sample.applied_version >= state.version:
            # The instance runs the latest version (or one this controller never pushed: it
            # restarted and lost its history; versions continue from the instance's).
            state.version = sample.applied_version
            state.placement = sample.physical_to_logical.clone()
        state.window.add(sample)
        newly_applied = sample.applied_version > state.applied_version
        state.applied_version = max(state.applied_version, sample.applied_version)
        return newly_applied

    def snapshot(self, instance_id: str) -> tuple[torch.Tensor, torch.Tensor, InstanceShape]:
        """(window logical load [L, N], placement in effect [L, P], shape) for :func:`decide`."""
        state = self.instances[instance_id]
        return state.window.logical_load(), state.placement.clone(), state.shape

    def commit(self, instance_id: str, decision: Decision) -> int | None:
        """Record a decision; an applied one becomes the next version (returned)."""
        state = self.instances[instance_id]
        state.history = [*state.history[-15:], decision]
        if not decision.apply:
            return None
        state.version += 1
        state.placement = decision.physical_to_logical.clone()
        return state.version


def _changed_field(old: InstanceShape, new: InstanceShape) -> str:
    for name in ("num_moe_layers", "num_logical", "num_physical", "ep_size"):
        if getattr(old, name) != getattr(new, name):
            return _FIELD[name]
    return "num_nodes" if old.num_nodes != new.num_nodes else "num_groups"
