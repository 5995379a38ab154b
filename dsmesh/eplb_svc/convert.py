"""Protos <-> the controller's plain values."""

from __future__ import annotations

import torch

from dsmesh.clients.eplb import load_report
from dsmesh.eplb_svc.controller import InstanceShape, InvalidLoad, LoadSample
from dsmesh.v1 import eplb_pb2 as pb


def _matrix(values, rows: int, cols: int, name: str) -> torch.Tensor:
    if len(values) != rows * cols:
        raise InvalidLoad(
            name,
            f"expected num_moe_layers * num_physical_experts = {rows * cols} values, "
            f"got {len(values)}",
        )
    return torch.tensor(list(values), dtype=torch.int64).view(rows, cols)


def _count(value: int) -> int:
    """proto3 0 means "unset": one node / one group."""
    return 1 if value == 0 else value


def sample_from_report(report: pb.ExpertLoadReport) -> LoadSample:
    """Validated :class:`LoadSample`; raises :class:`InvalidLoad` naming the bad field."""
    shape = InstanceShape(
        num_moe_layers=report.num_moe_layers,
        num_logical=report.num_logical_experts,
        num_physical=report.num_physical_experts,
        ep_size=report.ep_size,
        num_nodes=_count(report.num_nodes),
        num_groups=_count(report.num_groups),
    )
    if not report.instance_id:
        raise InvalidLoad("instance_id", "must not be empty")
    shape.validate()
    rows, cols = shape.physical_shape
    sample = LoadSample(
        instance_id=report.instance_id,
        shape=shape,
        physical_counts=_matrix(report.tokens_per_expert, rows, cols, "tokens_per_expert"),
        num_steps=report.window_steps,
        physical_to_logical=_matrix(report.physical_to_logical, rows, cols, "physical_to_logical"),
        applied_version=report.applied_version,
        last_swap_seconds=report.last_swap_seconds,
    )
    sample.validate()
    return sample


def report_from_sample(sample: LoadSample) -> pb.ExpertLoadReport:
    s = sample.shape
    return load_report(
        sample.instance_id,
        sample.physical_counts,
        sample.num_steps,
        sample.physical_to_logical,
        s.num_logical,
        s.ep_size,
        sample.applied_version,
        sample.last_swap_seconds,
        s.num_nodes,
        s.num_groups,
    )


def placement_proto(
    instance_id: str, version: int, p2l: torch.Tensor, before: float, after: float
) -> pb.Placement:
    return pb.Placement(
        instance_id=instance_id,
        version=version,
        num_moe_layers=p2l.shape[0],
        num_physical_experts=p2l.shape[1],
        physical_to_logical=p2l.reshape(-1).tolist(),
        balancedness_before=before,
        balancedness_after=after,
    )
