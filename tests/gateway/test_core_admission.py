"""The gateway core's admission wiring, in process (no instance, no broker listening): a
request waits while nothing can serve, then gets UNAVAILABLE after ``route_wait_s``; one that
waits in the queue longer than ``request_timeout_s`` gets DEADLINE_EXCEEDED; an aborted one
ends with finish_reason "abort"; each leaves the queue."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.tiny_model import default_model_dir
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.core import CoreLimits, GatewayError, GenerationCore, Placement
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.registry import Instance, InstanceRegistry
from tests.mesh import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def make_core(limits: CoreLimits) -> GenerationCore:
    model = default_model_dir()
    registry = InstanceRegistry(f"127.0.0.1:{free_port()}")  # nothing listens there
    return GenerationCore(
        registry,
        Tokenizer.from_dir(model),
        load_config(model),
        GatewayMetrics(registry.kv_pages),
        limits,
    )


async def drain(core: GenerationCore, rid: str) -> list:
    inp = core.prepare(rid, None, [5, 6, 7], SamplingParams(max_new_tokens=4))
    return [d async for d in core.generate(inp)]


async def test_no_instance_for_route_wait_is_unavailable() -> None:
    core = make_core(CoreLimits(route_wait_s=0.3))
    core.registry.start()  # polls: the broker is unreachable, so nothing is routable
    try:
        with pytest.raises(GatewayError) as info:
            await drain(core, "r1")
    finally:
        await core.registry.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy instance" in info.value.message
    queued = core.metrics.registry.get_sample_value("dsmesh_requests_queued")
    assert (core.admission.num_waiting, queued) == (0, 0)


async def test_a_request_waits_in_the_queue_at_most_the_request_timeout() -> None:
    core = make_core(CoreLimits(route_wait_s=100, request_timeout_s=0.2))
    with pytest.raises(GatewayError) as info:
        await drain(core, "r1")
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.message == "waited 0.2 s in the gateway queue"
    assert core.admission.num_waiting == 0 and not core.active


async def test_abort_takes_a_request_out_of_the_queue() -> None:
    core = make_core(CoreLimits(route_wait_s=100))
    task = asyncio.ensure_future(drain(core, "r1"))
    while not core.admission.is_waiting("r1"):
        await asyncio.sleep(0.01)
    assert await core.abort("r1")
    deltas = await task
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([], "abort")]
    assert core.admission.num_waiting == 0 and not core.active
    assert not await core.abort("r1")  # gone


async def test_abort_between_admission_and_the_first_call_ends_the_request() -> None:
    """An Abort that arrives after the queue handed the request its instance but before its
    coroutine called that instance: the request ends "abort" without calling it."""
    core = make_core(CoreLimits(route_wait_s=100))
    task = asyncio.ensure_future(drain(core, "r1"))
    while not core.admission.is_waiting("r1"):
        await asyncio.sleep(0.01)
    # what the pump does on dispatch: the ticket leaves the queue, the future gets a target
    # whose stub must not be called
    unusable = Instance("d0", 2, "127.0.0.1:1", None, stub=None)  # type: ignore[arg-type]
    core.admission.is_waiting = lambda rid: False  # type: ignore[method-assign]
    core.gate.waiting["r1"].set_result(Placement(unusable, None))
    assert await core.abort("r1")  # the coroutine has not resumed yet
    deltas = await task
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([], "abort")]
    assert not core.active and not core._aborted_unplaced
    outcomes = core.metrics.registry.get_sample_value("dsmesh_requests_total", {"outcome": "abort"})
    assert outcomes == 1
