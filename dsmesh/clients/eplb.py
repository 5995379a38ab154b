"""What an EP instance runs to take part in EPLB: :class:`EPLBLink`.

It streams the instance's load to eplb_svc every ``report_interval_s`` (``sample()`` returns
the load since its previous call, or None to skip) and watches the instance's placements,
calling ``on_placement(version, physical_to_logical [L, P] int64)`` for each new version.
Both loops reconnect on their own after errors (eplb restarts, network), so a missing or
restarting eplb never fails the instance; placements keep their versions across reconnects.
Calls wait for the channel to be ready rather than fail fast, so while eplb is down nothing
spins; gRPC's reconnect backoff (1 s growing to 120 s) bounds how soon a restart is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable

import grpc
import torch

from dsmesh.runtime.grpc_server import channel as make_channel
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import eplb_pb2 as pb
from dsmesh.v1 import eplb_pb2_grpc

log = logging.getLogger(__name__)

SampleFn = Callable[[], "pb.ExpertLoadReport | None | Awaitable[pb.ExpertLoadReport | None]"]
PlacementFn = Callable[[int, torch.Tensor], "None | Awaitable[None]"]


def load_report(
    instance_id: str,
    physical_counts: torch.Tensor,
    num_steps: int,
    physical_to_logical: torch.Tensor,
    num_logical: int,
    ep_size: int,
    applied_version: int = 0,
    last_swap_seconds: float = 0.0,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> pb.ExpertLoadReport:
    """The report of what an instance has: the counts of ``ExpertLoadRecorder.take()`` summed
    over its ranks ([L, P] int64), the running ``ExpertLocation.physical_to_logical`` [L, P]
    and the Rebalancer's version and swap time. ``num_groups``: the model's ``n_group`` for
    the hierarchical policy (1: global). eplb_svc validates it (``sample_from_report``)."""
    layers, physical = physical_to_logical.shape
    return pb.ExpertLoadReport(
        instance_id=instance_id,
        num_moe_layers=layers,
        num_physical_experts=physical,
        tokens_per_expert=physical_counts.to(torch.int64).reshape(-1).tolist(),
        window_steps=num_steps,
        num_logical_experts=num_logical,
        ep_size=ep_size,
        num_nodes=num_nodes,
        num_groups=num_groups,
        physical_to_logical=physical_to_logical.to(torch.int64).reshape(-1).tolist(),
        applied_version=applied_version,
        last_swap_seconds=last_swap_seconds,
    )


def placement_tensor(placement: pb.Placement) -> torch.Tensor:
    """[num_moe_layers, num_physical_experts] int64."""
    rows, cols = placement.num_moe_layers, placement.num_physical_experts
    values = placement.physical_to_logical
    if len(values) != rows * cols:
        raise ValueError(
            f"physical_to_logical: expected num_moe_layers * num_physical_experts = "
            f"{rows * cols} values, got {len(values)}"
        )
    return torch.tensor(list(values), dtype=torch.int64).view(rows, cols)


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class EPLBLink:
    def __init__(
        self,
        address: str,
        instance_id: str,
        sample: SampleFn,
        on_placement: PlacementFn,
        report_interval_s: float = 1.0,
        retry_s: float = 1.0,
        known_version: int = 0,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        if report_interval_s <= 0 or retry_s <= 0:
            raise ValueError("report_interval_s and retry_s must be positive")
        self.instance_id = instance_id
        self.report_interval_s = report_interval_s
        self.retry_s = retry_s
        self.known_version = known_version  # latest version handed to on_placement
        self.reports_sent = 0
        self._sample = sample
        self._on_placement = on_placement
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else make_channel(address)
        self._stub = eplb_pb2_grpc.EPLBStub(self._channel)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()

    async def start(self) -> EPLBLink:
        self._tasks = [
            asyncio.create_task(self._report_loop(), name="eplb-report"),
            asyncio.create_task(self._watch_loop(), name="eplb-watch"),
        ]
        return self

    def report_now(self) -> None:
        """Send the next report without waiting for the interval (e.g. right after a swap)."""
        self._wake.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> EPLBLink:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _report_loop(self) -> None:
        while True:
            call = self._stub.ReportLoad(wait_for_ready=True)
            try:
                while True:
                    report = await _maybe_await(self._sample())
                    if report is not None:
                        await call.write(report)
                        self.reports_sent += 1
                    await wait_set(self._wake, self.report_interval_s)
                    self._wake.clear()
            except Exception as exc:  # the stream, or the sample callable: retry either way
                log.warning("eplb report stream ended: %s; retrying", _details(exc))
            finally:
                call.cancel()
            await asyncio.sleep(self.retry_s)

    async def _watch_loop(self) -> None:
        while True:
            call = self._stub.WatchPlacement(
                pb.WatchPlacementRequest(
                    instance_id=self.instance_id, known_version=self.known_version
                ),
                wait_for_ready=True,
            )
            try:
                async for placement in call:
                    if placement.version <= self.known_version:
                        continue
                    await _maybe_await(
                        self._on_placement(placement.version, placement_tensor(placement))
                    )
                    self.known_version = placement.version
                log.info("eplb watch stream ended; reconnecting")
            except Exception as exc:  # the stream, or the placement callback: retry either way
                log.warning("eplb watch stream failed: %s; retrying", _details(exc))
            finally:
                call.cancel()
            await asyncio.sleep(self.retry_s)


def _details(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
