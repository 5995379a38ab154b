"""eplb_svc over real gRPC on loopback: an EPLBLink streams reports and watches placements."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsmesh.clients.eplb import EPLBLink
from dsmesh.eplb_svc.algorithm import balancedness, predicted_rank_load, rebalance_experts
from dsmesh.eplb_svc.convert import report_from_sample
from dsmesh.v1 import eplb_pb2 as pb
from tests.eplb.conftest import (
    SHAPE,
    WAIT_S,
    running_eplb,
    sample,
    skewed_counts,
    trivial_placement,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class Instance:
    """A fake EP instance: known skewed load, applies placements it is pushed."""

    def __init__(self, instance_id: str = "decode-0", seed: int = 0) -> None:
        self.instance_id = instance_id
        self.load = skewed_counts(seed)
        self.p2l = trivial_placement()
        self.applied_version = 0
        self.swap_s = 0.0
        self.placements: asyncio.Queue[tuple[int, torch.Tensor]] = asyncio.Queue()

    def sample(self):
        return report_from_sample(
            sample(self.load, self.p2l, 10, self.instance_id, self.applied_version, self.swap_s)
        )

    def on_placement(self, version: int, p2l: torch.Tensor) -> None:
        self.placements.put_nowait((version, p2l))

    async def next_placement(self) -> tuple[int, torch.Tensor]:
        return await asyncio.wait_for(self.placements.get(), WAIT_S)

    def apply(self, version: int, p2l: torch.Tensor, swap_s: float) -> None:
        self.p2l, self.applied_version, self.swap_s = p2l, version, swap_s


def metric_values(registry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def wait_until(predicate, timeout: float = WAIT_S) -> None:
    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def test_rebalance_pushes_versions_above_threshold_only() -> None:
    inst = Instance()
    async with running_eplb() as srv:
        link = EPLBLink(srv.address, inst.instance_id, inst.sample, inst.on_placement, 0.05)
        async with link:
            await wait_until(lambda: link.reports_sent >= 2)
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(), timeout=WAIT_S)
            assert [p.version for p in reply.placements] == [1] and not reply.skipped
            version, p2l = await inst.next_placement()
            assert version == 1
            load = await srv.stub.GetLoad(pb.GetLoadRequest(instance_id="decode-0"))
            window = torch.tensor(load.instances[0].tokens_per_logical_expert).view(3, 16)
            want = rebalance_experts(window, SHAPE.num_physical, 1, 1, SHAPE.ep_size)[0]
            assert torch.equal(p2l, want)
            before = balancedness(predicted_rank_load(window, inst.p2l, SHAPE.ep_size))
            after = balancedness(predicted_rank_load(window, want, SHAPE.ep_size))
            pushed = reply.placements[0]
            assert (pushed.balancedness_before, pushed.balancedness_after) == (before, after)
            assert after > before + 0.05

            # the instance swaps and says so; the next decision finds nothing to gain
            inst.apply(version, p2l, swap_s=0.25)
            link.report_now()
            await wait_until(lambda: _applied(srv) == 1)
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(instance_id="decode-0"))
            assert not reply.placements and len(reply.skipped) == 1
            assert reply.skipped[0].version == 0
            assert reply.skipped[0].balancedness_after - reply.skipped[0].balancedness_before < 0.05
            assert inst.placements.empty()

            # dry run computes and never applies, even forced; force applies
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(force=True, dry_run=True))
            assert not reply.placements and len(reply.skipped) == 1
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(force=True))
            assert [p.version for p in reply.placements] == [2]
            assert (await inst.next_placement())[0] == 2

            m = metric_values(srv.metrics.registry)
            labels = (("instance", "decode-0"),)
            assert m[("dsmesh_eplb_rebalances_total", labels)] == 2
            assert m[("dsmesh_eplb_placement_version", labels)] == 2
            assert m[("dsmesh_eplb_swap_seconds_count", labels)] == 1
            assert m[("dsmesh_eplb_swap_seconds_sum", labels)] == 0.25
            bal = {
                when: m[("dsmesh_expert_balancedness", (("instance", "decode-0"), ("when", when)))]
                for when in ("before", "after", "measured")
            }
            # the last decision (forced, same placement) predicts no change
            assert math.isclose(bal["before"], after) and math.isclose(bal["after"], after)
            assert 0 < bal["measured"] <= 1


def _applied(srv) -> float:
    """The applied version the instance reported, as the service exports it."""
    key = ("dsmesh_eplb_applied_version", (("instance", "decode-0"),))
    return metric_values(srv.metrics.registry).get(key, 0.0)


async def test_periodic_rebalance_and_reconnecting_watch() -> None:
    inst = Instance(seed=3)
    async with running_eplb(interval_s=0.1) as srv:
        async with EPLBLink(srv.address, "decode-0", inst.sample, inst.on_placement, 0.05):
            version, p2l = await inst.next_placement()
            assert version == 1
            inst.apply(version, p2l, 0.01)
        # a new link that already runs version 1 is not sent it again
        async with EPLBLink(
            srv.address, "decode-0", inst.sample, inst.on_placement, 0.05, known_version=1
        ) as link:
            await wait_until(lambda: link.reports_sent >= 3)
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(force=True))
            assert reply.placements[0].version == 2
            assert (await inst.next_placement())[0] == 2
            assert inst.placements.empty()


async def test_bad_reports_are_refused_naming_the_field_and_the_service_survives() -> None:
    good = sample(skewed_counts(0), trivial_placement())
    cases = {
        "tokens_per_expert": lambda r: r.tokens_per_expert.pop(),
        "physical_to_logical": lambda r: r.physical_to_logical.append(0),
        "num_physical_experts": lambda r: setattr(r, "ep_size", 3),  # 20 over 3 ranks
        "num_groups": lambda r: setattr(r, "num_groups", 3),  # 16 experts in 3 groups
        "ep_size": lambda r: setattr(r, "ep_size", 0),
        "instance_id": lambda r: setattr(r, "instance_id", ""),
        "last_swap_seconds": lambda r: setattr(r, "last_swap_seconds", -1.0),
    }
    async with running_eplb() as srv:
        for name, spoil in cases.items():
            report = report_from_sample(good)
            spoil(report)
            call = srv.stub.ReportLoad()
            await call.write(report)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.done_writing()
                await asyncio.wait_for(call, WAIT_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert name in info.value.details(), (name, info.value.details())
        # a shape change of a known instance is refused too
        call = srv.stub.ReportLoad()
        await call.write(report_from_sample(good))
        changed = report_from_sample(good)
        changed.ep_size = 2
        await call.write(changed)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call, WAIT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ep_size" in info.value.details()
        # still serving: health, a good report, a rebalance
        health = health_pb2_grpc.HealthStub(srv.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="dsmesh.v1.EPLB"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = srv.stub.ReportLoad()
        await call.write(report_from_sample(good))
        await call.done_writing()
        await asyncio.wait_for(call, WAIT_S)
        reply = await srv.stub.Rebalance(pb.RebalanceRequest(instance_id="decode-0"))
        assert len(reply.placements) == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await srv.stub.Rebalance(pb.RebalanceRequest(instance_id="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in srv.stub.WatchPlacement(pb.WatchPlacementRequest()):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "instance_id" in info.value.details()


async def test_watch_streams_end_when_the_service_stops() -> None:
    async with running_eplb() as srv:
        call = srv.stub.WatchPlacement(pb.WatchPlacementRequest(instance_id="decode-0"))
        await asyncio.sleep(0.1)  # let the stream open
        reader = asyncio.ensure_future(call.read())
    assert await asyncio.wait_for(reader, WAIT_S) is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_link_survives_an_eplb_restart() -> None:
    """The instance keeps its version across an eplb restart; the new controller adopts it
    and continues the numbering."""
    inst = Instance(seed=4)
    async with running_eplb() as srv:
        port = srv.port
        link = EPLBLink(
            srv.address, inst.instance_id, inst.sample, inst.on_placement, 0.05, retry_s=0.1
        )
        await link.start()
        await wait_until(lambda: link.reports_sent >= 1)
        await srv.stub.Rebalance(pb.RebalanceRequest(force=True))
        version, p2l = await inst.next_placement()
        inst.apply(version, p2l, 0.01)
    try:
        await asyncio.sleep(0.3)  # eplb is gone for a while: the link keeps retrying
        assert all(not task.done() for task in link._tasks)
        async with running_eplb(port=port) as srv:

            async def adopted() -> bool:
                reply = await srv.stub.GetLoad(pb.GetLoadRequest(), wait_for_ready=True)
                return bool(reply.instances) and reply.instances[0].version == 1

            async def wait_adopted() -> None:
                while not await adopted():
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(wait_adopted(), 3 * WAIT_S)  # reconnect backoff
            reply = await srv.stub.Rebalance(pb.RebalanceRequest(force=True))
            assert reply.placements[0].version == 2
            assert (await inst.next_placement())[0] == 2
    finally:
        await link.close()
