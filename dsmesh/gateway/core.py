"""The gateway's request pipeline, shared by gRPC, REST and the OpenAI routes.

validate + tokenise -> admission (wait in the queue until a target has room) -> run it on a
(prefill, decode) pair or a unified instance -> detokenise incrementally, apply stop strings
-> stream deltas; if the instance serving it is lost, send it on and resume (migration.py).
No protocol code here: callers convert.

:class:`GenerationCore` validates requests and runs each one through its stages: the
admission queue on the event loop (admission_gate.py), the calls to the instances it was
placed on (dispatch.py) and the deltas made of their messages (outputs.py). The request's
data types live in request.py and are re-exported here, where the APIs import them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from dsmesh.clients.pd import PDError
from dsmesh.engine.errors import InvalidRequestError, check_prompt
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.admission import AdmissionQueue
from dsmesh.gateway.admission_gate import AbortedInQueue, AdmissionGate
from dsmesh.gateway.dispatch import abort_placed, first_in_context, open_stream
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.migration import MOVABLE_CODES, Migration
from dsmesh.gateway.outputs import RequestOutput
from dsmesh.gateway.registry import Instance, InstanceRegistry
from dsmesh.gateway.request import (
    ChoiceGroup,
    CoreLimits,
    Delta,
    GatewayError,
    GenerationInput,
    Placement,
    invalid,
)
from dsmesh.gateway.routing import largest_request_tokens
from dsmesh.runtime import telemetry
from dsmesh.v1 import prefill_pb2

__all__ = [  # the core, and the request's types its callers import from here
    "CoreLimits",
    "Delta",
    "GatewayError",
    "GenerationCore",
    "GenerationInput",
    "Placement",
    "invalid",
]

log = logging.getLogger(__name__)


class GenerationCore:
    """The pipeline the APIs call: :meth:`prepare` validates and tokenises, :meth:`generate`
    streams a request's deltas, :meth:`abort` ends it wherever it is. Event loop only."""

    def __init__(
        self,
        registry: InstanceRegistry,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        metrics: GatewayMetrics,
        limits: CoreLimits,
    ) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.metrics = metrics
        self.limits = limits
        self.admission = AdmissionQueue(
            limits.max_inflight, limits.max_queued, limits.kv_routing_weight
        )
        self.gate = AdmissionGate(
            self.admission, registry, metrics, limits, model_config.max_position_embeddings
        )
        # request_id -> where it runs; None while it waits for admission
        self.active: dict[str, Placement | None] = {}
        # a request of n > 1 choices (dsmesh/gateway/choices.py): its id -> its choices, so that
        # Abort with the client's id reaches them all
        self.choice_groups: dict[str, ChoiceGroup] = {}
        # requests aborted between leaving the queue and their first call to an instance
        # (admitted, or put back after a refusal): they end "abort" before that call
        self._aborted_unplaced: set[str] = set()
        registry.on_update.append(self.gate.pump)

    # ---- validation -------------------------------------------------------------------------

    def prepare(
        self,
        request_id: str,
        text: str | None,
        input_ids: list[int] | None,
        params: SamplingParams,
        add_special_tokens: bool = True,
        prompt_only: bool = False,
    ) -> GenerationInput:
        """Validate and tokenise; raises GatewayError(INVALID_ARGUMENT) naming the field.
        ``prompt_only``: see :class:`GenerationInput` (``params`` then ask for 1 new token)."""
        if request_id and len(request_id) > 256:
            raise invalid("request_id", "must be at most 256 characters")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if input_ids:
            ids = list(input_ids)
            field = "input_ids"
        elif text:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            field = "text"
        else:
            raise invalid("input_ids", "the prompt is empty: give text or input_ids")
        try:
            check_prompt(
                ids, self.model_config.vocab_size, self.model_config.max_position_embeddings, field
            )
        except InvalidRequestError as exc:
            raise invalid(exc.field, exc.reason) from exc
        try:
            params.validate()
            params.check_vocab(self.model_config.vocab_size)
        except InvalidRequestError as exc:
            raise invalid(f"sampling.{exc.field}", exc.reason) from exc
        return GenerationInput(request_id, ids, params, prompt_only)

    def room_to_generate(self, num_prompt_tokens: int) -> int:
        """How many tokens a prompt of ``num_prompt_tokens`` may generate when the client sets
        no limit (OpenAI's meaning of an omitted ``max_tokens``): the room left in the model's
        context after the prompt, and no more than the largest KV pool that can serve holds
        beside it (an instance refuses a request larger than its pool). At least 1: a prompt
        with no room left fails its own check in ``prepare``."""
        loads = self.registry.loads()
        largest = largest_request_tokens(
            list(loads.prefills), list(loads.decodes), list(loads.unifieds)
        )
        room = self.model_config.max_position_embeddings - num_prompt_tokens
        if largest is not None:
            room = min(room, largest - num_prompt_tokens)
        return max(1, room)

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, inp: GenerationInput, trace_parent: Context | None = None
    ) -> AsyncIterator[Delta]:
        """Stream deltas; the last one has ``finish_reason``. The request first waits its turn
        in the admission queue (part of its time to first token). Leaving early cancels it
        wherever it is: out of the queue, or on both sides of the mesh (pages are freed).
        ``trace_parent``: the caller's trace context (an HTTP traceparent, or the gRPC server
        span); the request's spans hang below it. When the instance serving it is lost, the
        request moves on (up to ``migration_limit`` times, dsmesh/gateway/migration.py): it
        waits in the queue again and resumes after the tokens already streamed, so the deltas
        go on with no gap and no repeat."""
        if inp.request_id in self.active:
            self.metrics.requests.labels("rejected").inc()
            raise GatewayError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {inp.request_id!r} is already in flight; a request id is used once",
            )
        self.active[inp.request_id] = None  # taken before the first await: no duplicate runs
        start = time.monotonic()
        m = self.metrics
        m.waiting.inc()
        state = {"waiting": True, "running": False, "outcome": "error", "held": True}
        span = telemetry.tracer().start_span(
            "gateway.request",
            context=trace_parent,
            kind=trace.SpanKind.SERVER,
            attributes={
                "dsmesh.request_id": inp.request_id,
                "dsmesh.prompt_tokens": len(inp.prompt_ids),
            },
        )
        ctx = trace.set_span_in_context(span, trace_parent)
        output = RequestOutput(inp, self.tokenizer, m, start, state)
        migration = Migration(inp, self.limits.migration_limit)
        try:
            attempt, cur = 0, inp
            while True:
                try:
                    placed = await self.gate.admit(
                        cur, ctx, first=attempt > 0, wait_s=self._time_left(start)
                    )
                except AbortedInQueue:
                    state["outcome"] = "abort"
                    yield output.aborted()
                    return
                placed = dataclasses.replace(placed, call_id=migration.call_id(attempt))
                self.active[inp.request_id] = placed
                if inp.request_id in self._aborted_unplaced:
                    state["outcome"] = "abort"
                    state["held"] = False  # no instance saw this attempt
                    yield output.aborted()
                    return
                if attempt == 0:
                    m.prompt_tokens.inc(len(inp.prompt_ids))
                if placed.prefill is None:
                    span.set_attribute("dsmesh.unified", placed.decode.instance_id)
                else:
                    span.set_attribute("dsmesh.prefill", placed.prefill.instance_id)
                    span.set_attribute("dsmesh.decode", placed.decode.instance_id)
                sent = False
                try:
                    async for delta in self._stream(cur, placed, output, migration, ctx):
                        sent = True
                        yield delta
                    return
                except GatewayError as exc:
                    if exc.code in MOVABLE_CODES:
                        _skip_lost(placed, exc.side)
                    if not sent and self._requeues(exc, start):
                        # Refused for room before any work: back to the head of the queue.
                        m.requeued.inc()
                        span.add_event("gateway.requeued", {"dsmesh.reason": exc.message})
                    elif migration.may_move(exc.code, self._time_left(start)):
                        cur = self._migrate(migration, placed, exc, span)
                        await self.registry.refresh()  # route on a view taken after the loss
                    else:
                        raise
                self.active[inp.request_id] = None
                self.admission.release(inp.request_id, time.monotonic(), held=False)
                attempt += 1
        except GatewayError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                state["outcome"] = "rejected"  # the queue, or a full prefill or decode
                state["held"] = False  # refused before it took pages
            span.set_status(trace.StatusCode.ERROR, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if state["outcome"] == "error":
                state["outcome"] = "cancelled"  # the client went away
            raise
        finally:
            span.set_attribute("dsmesh.outcome", state["outcome"])
            span.end()
            self.active.pop(inp.request_id, None)
            self._aborted_unplaced.discard(inp.request_id)
            self.admission.release(inp.request_id, time.monotonic(), held=state["held"])
            self.gate.pump()  # what it held may let the next one in
            if state["waiting"]:
                m.waiting.dec()
            if state["running"]:
                m.running.dec()
            m.requests.labels(state["outcome"]).inc()

    def _time_left(self, start: float) -> float:
        return self.limits.request_timeout_s - (time.monotonic() - start)

    def _migrate(
        self, migration: Migration, placed: Placement, exc: GatewayError, span: trace.Span
    ) -> GenerationInput:
        """The instance serving the request was lost (``exc``): the request's next attempt
        resumes where the client's stream is (dsmesh/gateway/migration.py)."""
        lost = _lost(placed, exc.side)
        resumed = migration.resume()
        self.metrics.migrated.labels(exc.side or "unknown").inc()
        span.add_event(
            "gateway.migrated",
            {
                "dsmesh.reason": exc.message,
                "dsmesh.from": ",".join(i.instance_id for i in lost),
                "dsmesh.resumed_tokens": resumed.params.resumed_tokens,
                "dsmesh.migrations": migration.moves,
            },
        )
        log.info(
            "request %s moves after %s (%d tokens generated, move %d of %d)",
            migration.inp.request_id,
            exc.message,
            resumed.params.resumed_tokens,
            migration.moves,
            migration.limit,
        )
        return resumed

    def _requeues(self, exc: GatewayError, start: float) -> bool:
        """Whether a request whose instance answered ``exc`` before sending anything waits in
        the queue again: the instance refused it for room (RESOURCE_EXHAUSTED: nothing ran,
        no page is held), and its time in the gateway (``--request-timeout``) is not over.
        A mesh that accepted a request does not refuse it later for a burst."""
        return exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self._time_left(start) > 0

    async def _stream(
        self,
        inp: GenerationInput,
        placed: Placement,
        output: RequestOutput,
        migration: Migration,
        ctx: Context,
    ) -> AsyncIterator[Delta]:
        """One attempt: the deltas of the instance(s) ``placed`` for ``inp`` (the request,
        or its resumed input after a move), through the request's one ``output``."""
        resumed = migration.moves > 0

        def on_prefilled(answer: prefill_pb2.PrefillResponse) -> None:
            if not resumed:  # a resumed prompt's cached tokens are not the client's prompt's
                output.prefilled(answer)
            self.admission.prefilled(inp.request_id)  # left prefill's queue: the next
            self.gate.pump()  # may go there
            self.metrics.kv_handoff(answer)

        stream = open_stream(inp, placed, self.limits, self.registry, on_prefilled)
        try:

            def on_start() -> None:  # from now on, load reports account for the request
                self.admission.started(inp.request_id, time.monotonic())

            async for msg in first_in_context(stream, ctx, on_start):
                delta = output.delta(msg, unified=placed.prefill is None, moves=migration.moves)
                migration.streamed(list(msg.token_ids))
                yield delta
                if delta.finish_reason is not None:
                    return
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE, "the stream ended without a finish", side="decode"
            )
        except PDError as exc:
            raise GatewayError(exc.code, exc.message, side=exc.side) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        """Abort a request: one still in the queue leaves it, one running is aborted where it
        runs; either way its stream ends with finish_reason "abort"."""
        if self.gate.take_out(request_id):
            return True
        if request_id not in self.active:
            return False
        placed = self.active[request_id]
        if placed is None:  # admitted, its coroutine not yet resumed; or between attempts
            self._aborted_unplaced.add(request_id)
            return True
        return await abort_placed(placed, request_id)


def _lost(placed: Placement, side: str) -> list[Instance]:
    """The instances of ``placed`` that a failure on ``side`` concerns: the one named, or
    both of a pair when no side is known."""
    by_side = {"decode": placed.decode, "unified": placed.decode, "prefill": placed.prefill}
    named = by_side.get(side)
    lost = [named] if named is not None else [placed.decode, placed.prefill]
    return [inst for inst in lost if inst is not None]


def _skip_lost(placed: Placement, side: str) -> None:
    """Routing skips instances a call found gone (UNAVAILABLE) until they answer a load poll
    again, so requests arriving before the next poll do not go there."""
    for inst in _lost(placed, side):
        inst.healthy = False
