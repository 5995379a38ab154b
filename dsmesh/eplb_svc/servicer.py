"""``dsmesh.v1.EPLB`` over grpc.aio: converts protos, delegates to :class:`Controller`, runs
the periodic rebalance and pushes new placement versions to WatchPlacement streams.

Placement computation runs in a worker thread on a snapshot of the window (it takes up to a
second for DeepSeek-V3 shapes), one instance at a time; nothing polls: watchers sleep on a
per-instance :class:`asyncio.Event` that is set on every new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from dsmesh.eplb_svc.controller import Controller, InvalidLoad, decide
from dsmesh.eplb_svc.convert import placement_proto, sample_from_report
from dsmesh.eplb_svc.metrics import EPLBMetrics
from dsmesh.v1 import eplb_pb2 as pb
from dsmesh.v1 import eplb_pb2_grpc

if TYPE_CHECKING:
    from dsmesh.eplb_svc.config import EPLBConfig

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _guarded(method: Callable[..., Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
    """Bad input -> INVALID_ARGUMENT naming the field; any other error -> INTERNAL; the
    service keeps running either way."""

    @functools.wraps(method)
    async def handler(self: EPLBServicer, request: Any, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except InvalidLoad as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"eplb internal error: {exc}")

    return handler


class EPLBServicer(eplb_pb2_grpc.EPLBServicer):
    def __init__(self, config: EPLBConfig, metrics: EPLBMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.controller = Controller(config.window_steps)
        self._placements: dict[str, pb.Placement] = {}  # latest pushed, per instance
        self._changed: dict[str, asyncio.Event] = {}
        self._decide_lock = asyncio.Lock()
        self._closing = False
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick())

    async def close(self) -> None:
        """End watch streams and the periodic rebalance."""
        self._closing = True
        for event in self._changed.values():
            event.set()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # -- RPCs ------------------------------------------------------------------------------

    @_guarded
    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.ExpertLoadReport], context
    ) -> pb.ReportAck:
        async for report in request_iterator:
            sample = sample_from_report(report)
            if self.controller.report(sample):
                self.metrics.applied(
                    sample.instance_id, sample.applied_version, sample.last_swap_seconds
                )
        return pb.ReportAck()

    async def WatchPlacement(
        self, request: pb.WatchPlacementRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Placement]:
        if not request.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "instance_id: must not be empty")
        if request.known_version < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"known_version: must not be negative, got {request.known_version}",
            )
        known = request.known_version
        while not self._closing:
            latest = self._placements.get(request.instance_id)
            if latest is not None and latest.version > known:
                known = latest.version
                yield latest
                continue
            await self._event(request.instance_id).wait()

    @_guarded
    async def Rebalance(self, request: pb.RebalanceRequest, context) -> pb.RebalanceResponse:
        if request.instance_id and request.instance_id not in self.controller.instances:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"instance_id: no load reported by instance {request.instance_id!r}",
            )
        ids = [request.instance_id] if request.instance_id else list(self.controller.instances)
        out = pb.RebalanceResponse()
        for instance_id in ids:
            placement, applied = await self.rebalance(instance_id, request.force, request.dry_run)
            (out.placements if applied else out.skipped).append(placement)
        return out

    @_guarded
    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.GetLoadResponse:
        if request.instance_id and request.instance_id not in self.controller.instances:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"instance_id: no load reported by instance {request.instance_id!r}",
            )
        ids = [request.instance_id] if request.instance_id else list(self.controller.instances)
        out = pb.GetLoadResponse()
        for instance_id in ids:
            state = self.controller.instances[instance_id]
            s = state.shape
            out.instances.append(
                pb.InstanceLoad(
                    instance_id=instance_id,
                    num_moe_layers=s.num_moe_layers,
                    num_logical_experts=s.num_logical,
                    num_physical_experts=s.num_physical,
                    ep_size=s.ep_size,
                    num_nodes=s.num_nodes,
                    num_groups=s.num_groups,
                    window_steps=state.window.num_steps,
                    tokens_per_logical_expert=state.window.logical_load().reshape(-1).tolist(),
                    tokens_per_expert=state.window.physical_load().reshape(-1).tolist(),
                    physical_to_logical=state.placement.reshape(-1).tolist(),
                    version=state.version,
                    applied_version=state.applied_version,
                )
            )
        return out

    # -- policy ----------------------------------------------------------------------------

    async def rebalance(
        self, instance_id: str, force: bool, dry_run: bool = False
    ) -> tuple[pb.Placement, bool]:
        """Compute a placement for one instance; apply (push) it when it passes the threshold
        or ``force``, unless ``dry_run``. Returns (placement, applied)."""
        async with self._decide_lock:
            load, current, shape = self.controller.snapshot(instance_id)
            decision = await asyncio.to_thread(
                decide, load, current, shape, self.config.threshold, force
            )
            state = self.controller.instances[instance_id]
            self.metrics.measured(instance_id, state.measured_balancedness())
            version = None if dry_run else self.controller.commit(instance_id, decision)
            applied = version is not None
            if not dry_run:
                self.metrics.decided(instance_id, decision.before, decision.after, applied)
            # version 0: computed only, never pushed
            placement = placement_proto(
                instance_id,
                version or 0,
                decision.physical_to_logical,
                decision.before,
                decision.after,
            )
            if version is not None:
                self._publish(placement)
                self.metrics.pushed(instance_id, version)
                log.info(
                    "instance %s: placement v%d, balancedness %.3f -> %.3f",
                    instance_id,
                    version,
                    decision.before,
                    decision.after,
                )
            return placement, applied

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            for instance_id, state in list(self.controller.instances.items()):
                if state.window.num_steps == 0:
                    continue
                try:
                    await self.rebalance(instance_id, force=False)
                except Exception:
                    log.exception("periodic rebalance of %s failed", instance_id)

    def _publish(self, placement: pb.Placement) -> None:
        self._placements[placement.instance_id] = placement
        old = self._event(placement.instance_id)
        self._changed[placement.instance_id] = asyncio.Event()
        old.set()

    def _event(self, instance_id: str) -> asyncio.Event:
        if instance_id not in self._changed:
            self._changed[instance_id] = asyncio.Event()
        return self._changed[instance_id]
