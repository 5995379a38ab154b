"""The admission queue on the event loop: the gateway core's wiring of the pure policy in
dsmesh/gateway/admission.py.

A request the queue cannot place at once waits on a future; :meth:`AdmissionGate.pump`
resolves it with the request's :class:`Placement` when a target has room (after a registry
poll, when a request ends, or when one leaves prefill's queue), or fails it with the queue's
error as a :class:`GatewayError`. Event loop only.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from opentelemetry.context import Context

from dsmesh.gateway.admission import (
    AdmissionError,
    AdmissionQueue,
    QueueFull,
    Ticket,
    TooLarge,
    Unroutable,
)
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.prefix_index import PromptPages
from dsmesh.gateway.registry import InstanceRegistry
from dsmesh.gateway.request import CoreLimits, GatewayError, GenerationInput, Placement, invalid
from dsmesh.gateway.routing import Target
from dsmesh.runtime import telemetry


class AbortedInQueue(Exception):
    """The Abort RPC took a request out of the queue."""


_ADMISSION_CODES = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unroutable: grpc.StatusCode.UNAVAILABLE,
}


class AdmissionGate:
    """Requests wait here for a target. ``queue`` decides who goes where; this holds the
    futures the waiting requests' coroutines wait on (``waiting``, by request id).
    ``max_context``: the model's context length, which caps a request's tokens."""

    def __init__(
        self,
        queue: AdmissionQueue,
        registry: InstanceRegistry,
        metrics: GatewayMetrics,
        limits: CoreLimits,
        max_context: int,
    ) -> None:
        self.queue = queue
        self.registry = registry
        self.metrics = metrics
        self.limits = limits
        self.max_context = max_context
        self.waiting: dict[str, asyncio.Future[Placement]] = {}

    async def admit(
        self, inp: GenerationInput, ctx: Context, first: bool = False, wait_s: float | None = None
    ) -> Placement:
        """Wait until the admission queue hands this request a target; raises GatewayError
        (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when it is full while no
        instance can serve, INVALID_ARGUMENT when no instance could ever hold it, UNAVAILABLE
        when no instance can serve for ``route_wait_s``, DEADLINE_EXCEEDED after ``wait_s``
        (default ``request_timeout_s``) in the queue). ``first``: at the head of the queue,
        past its bound (a request the gateway accepted earlier: re-queued or migrated)."""
        wait_s = self.limits.request_timeout_s if wait_s is None else max(0.0, wait_s)
        prompt = len(inp.prompt_ids)
        total = min(prompt + inp.params.max_new_tokens, self.max_context)
        pages = PromptPages(inp.prompt_ids) if self.limits.kv_routing_weight > 0 else None
        ticket = Ticket(inp.request_id, prompt, total, pages)
        try:
            target = self.queue.submit(ticket, self.registry.loads(), time.monotonic(), first=first)
        except AdmissionError as exc:
            raise _gateway_error(exc) from None
        if target is not None:
            return self.place(target)
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self.waiting[inp.request_id] = future
        self.metrics.queued.inc()
        try:
            with telemetry.tracer().start_as_current_span("gateway.queue", context=ctx):
                return await asyncio.wait_for(future, wait_s)
        except TimeoutError:
            raise GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"waited {self.limits.request_timeout_s:g} s in the gateway queue",
            ) from None
        finally:
            self.waiting.pop(inp.request_id, None)
            self.metrics.queued.dec()

    def pump(self) -> None:
        """Hand targets to waiting requests that fit now (after a poll, or a request ended)."""
        route_wait_s = self.limits.route_wait_s
        if route_wait_s is None:  # wait for an instance until the request's deadline
            route_wait_s = self.limits.request_timeout_s
        pumped = self.queue.pump(self.registry.loads(), time.monotonic(), route_wait_s)
        for ticket, target in pumped.dispatched:
            future = self.waiting.get(ticket.request_id)
            if future is None or future.done():  # gone already: give the target back
                self.queue.release(ticket.request_id, time.monotonic(), held=False)
                continue
            try:
                future.set_result(self.place(target))
            except GatewayError as exc:
                self.queue.release(ticket.request_id, time.monotonic(), held=False)
                future.set_exception(exc)
        for ticket, error in pumped.failed:
            future = self.waiting.get(ticket.request_id)
            if future is not None and not future.done():
                future.set_exception(_gateway_error(error))

    def place(self, target: Target) -> Placement:
        decode = self.registry.instances.get(target.instance_id)
        prefill = (
            None if target.prefill_id is None else self.registry.instances.get(target.prefill_id)
        )
        if decode is None or (target.prefill_id is not None and prefill is None):
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the chosen instance just left")
        self.metrics.routing.labels(target.reason).inc()
        return Placement(decode, prefill)

    def take_out(self, request_id: str) -> bool:
        """Abort a request still waiting in the queue: it leaves the queue, and its
        :meth:`admit` raises :class:`AbortedInQueue`. False when it is not waiting."""
        future = self.waiting.get(request_id)
        if future is None or not self.queue.is_waiting(request_id):
            return False
        self.queue.release(request_id, time.monotonic())
        if not future.done():
            future.set_exception(AbortedInQueue())
        return True


def _gateway_error(exc: AdmissionError) -> GatewayError:
    if isinstance(exc, TooLarge):
        return invalid(exc.field, str(exc))
    if isinstance(exc, QueueFull) and exc.unroutable:  # a role is missing (e.g. restarting)
        return GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc))
    return GatewayError(_ADMISSION_CODES.get(type(exc), grpc.StatusCode.UNAVAILABLE), str(exc))
