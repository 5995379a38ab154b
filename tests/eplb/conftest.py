"""A real loopback eplb server per test, and load samples with a known skew."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch

from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.eplb_svc.controller import InstanceShape, LoadSample
from dsmesh.eplb_svc.metrics import EPLBMetrics
from dsmesh.eplb_svc.service import serve
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import eplb_pb2_grpc

WAIT_S = 5.0  # upper bound for anything a test waits on
SHAPE = InstanceShape(num_moe_layers=3, num_logical=16, num_physical=20, ep_size=4)


def skewed_counts(seed: int, shape: InstanceShape = SHAPE) -> torch.Tensor:
    """[L, N] int64 logical token counts: a few hot experts per layer."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, shape.num_logical + 1, dtype=torch.float64)
    perm = torch.stack(
        [torch.randperm(shape.num_logical, generator=g) for _ in range(shape.num_moe_layers)]
    )
    return (ranks.pow(-1.2).gather(0, perm.flatten()).view(perm.shape) * 10_000).round().long()


def trivial_placement(shape: InstanceShape = SHAPE) -> torch.Tensor:
    return round_robin_placement(
        shape.num_moe_layers,
        shape.num_logical,
        shape.ep_size,
        shape.num_physical - shape.num_logical,
    ).physical_to_logical


def physical_counts(logical: torch.Tensor, p2l: torch.Tensor) -> torch.Tensor:
    """Route ``logical`` [L, N] counts onto ``p2l`` [L, P]: a hot expert's tokens go to its
    first replica (what matters is the logical sum)."""
    out = torch.zeros(p2l.shape, dtype=torch.int64)
    for layer in range(p2l.shape[0]):
        seen: set[int] = set()
        for phys, e in enumerate(p2l[layer].tolist()):
            if e not in seen:
                out[layer, phys] = logical[layer, e]
                seen.add(e)
    return out


def sample(
    logical: torch.Tensor,
    p2l: torch.Tensor,
    steps: int = 10,
    instance_id: str = "decode-0",
    applied_version: int = 0,
    swap_s: float = 0.0,
    shape: InstanceShape = SHAPE,
) -> LoadSample:
    return LoadSample(
        instance_id, shape, physical_counts(logical, p2l), steps, p2l, applied_version, swap_s
    )


@dataclass
class Server:
    port: int
    stub: eplb_pb2_grpc.EPLBStub
    channel: grpc.aio.Channel
    metrics: EPLBMetrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_eplb(**overrides) -> AsyncIterator[Server]:
    fields = dict(interval_s=3600.0, threshold=0.05, window_steps=100, drain_timeout_s=0.5)
    fields.update(overrides)
    config = EPLBConfig(**fields)
    metrics = EPLBMetrics()
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(config, stop, ready.set_result, metrics))
    port = await asyncio.wait_for(ready, WAIT_S)
    chan = channel(f"127.0.0.1:{port}")
    try:
        yield Server(port, eplb_pb2_grpc.EPLBStub(chan), chan, metrics)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        await chan.close()
