"""The gateway's request pipeline, shared by gRPC, REST and the OpenAI routes.

validate + tokenise -> pick a (prefill, decode) pair -> run PD -> detokenise incrementally,
apply stop strings -> stream deltas. No protocol code here: callers convert.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from dsmesh import telemetry
from dsmesh.convert import sampling_to_proto
from dsmesh.pd_client import PDError, generate_pd
from dsmesh.v1 import generation_pb2
from engine.config import ModelConfig
from engine.errors import InvalidRequestError, check_prompt
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from gateway.metrics import GatewayMetrics
from gateway.registry import Instance, InstanceRegistry, NoInstanceError
from gateway.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """A request failed; ``code`` is the gRPC status (REST maps it to an HTTP status)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass(frozen=True)
class GenerationInput:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Delta:
    """One message to the client: new tokens, their text, and the end when it comes."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class CoreLimits:
    request_timeout_s: float = 600.0
    handoff_timeout_s: float = 30.0
    route_wait_s: float = 5.0  # how long a request may wait for a healthy instance pair
    max_inflight: int = 512  # requests in flight at most; more get RESOURCE_EXHAUSTED (429)


class GenerationCore:
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
        # request_id -> its (prefill, decode) instances; None while it is being routed
        self.active: dict[str, tuple[Instance, Instance] | None] = {}
        self.inflight = 0

    # ---- validation -------------------------------------------------------------------------

    def prepare(
        self,
        request_id: str,
        text: str | None,
        input_ids: list[int] | None,
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> GenerationInput:
        """Validate and tokenise; raises GatewayError(INVALID_ARGUMENT) naming the field."""
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
            raise invalid(exc.field, str(exc).split(": ", 1)[1]) from exc
        try:
            params.validate()
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise invalid(f"sampling.{name}", str(exc)) from exc
        return GenerationInput(request_id, ids, params)

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, inp: GenerationInput, trace_parent: Context | None = None
    ) -> AsyncIterator[Delta]:
        """Stream deltas; the last one has ``finish_reason``. Leaving early cancels both
        sides of the request (pages are freed). ``trace_parent``: the caller's trace context
        (an HTTP traceparent, or the gRPC server span); the request's spans hang below it."""
        if inp.request_id in self.active:
            self.metrics.requests.labels("rejected").inc()
            raise GatewayError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {inp.request_id!r} is already in flight; a request id is used once",
            )
        if self.inflight >= self.limits.max_inflight:
            self.metrics.requests.labels("rejected").inc()
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway is at capacity ({self.inflight} requests in flight); retry later",
            )
        self.inflight += 1
        self.active[inp.request_id] = None  # taken before the first await: no duplicate runs
        start = time.monotonic()
        m = self.metrics
        m.waiting.inc()
        state = {"waiting": True, "running": False, "outcome": "error"}
        try:
            prefill, decode = await self._route(inp)
            self.active[inp.request_id] = (prefill, decode)
            m.prompt_tokens.inc(len(inp.prompt_ids))
            span = telemetry.tracer().start_span(
                "gateway.request",
                context=trace_parent,
                kind=trace.SpanKind.SERVER,
                attributes={
                    "dsmesh.request_id": inp.request_id,
                    "dsmesh.prompt_tokens": len(inp.prompt_ids),
                    "dsmesh.prefill": prefill.instance_id,
                    "dsmesh.decode": decode.instance_id,
                },
            )
            ctx = trace.set_span_in_context(span, trace_parent)
            try:
                async for delta in self._stream(inp, prefill, decode, start, state, ctx):
                    yield delta
            except GatewayError as exc:
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    state["outcome"] = "rejected"  # a full prefill or decode refused it
                span.set_status(trace.StatusCode.ERROR, exc.message)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                if state["outcome"] == "error":
                    state["outcome"] = "cancelled"  # the client went away
                raise
            finally:
                span.set_attribute("dsmesh.outcome", state["outcome"])
                span.end()
        finally:
            self.inflight -= 1
            self.active.pop(inp.request_id, None)
            if state["waiting"]:
                m.waiting.dec()
            if state["running"]:
                m.running.dec()
            m.requests.labels(state["outcome"]).inc()

    async def _route(self, inp: GenerationInput):
        deadline = time.monotonic() + self.limits.route_wait_s
        while True:
            try:
                total = len(inp.prompt_ids) + inp.params.max_new_tokens
                return self.registry.pick(len(inp.prompt_ids), 0, total)
            except NoInstanceError as exc:
                if time.monotonic() > deadline:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
                await self.registry.wait_healthy(max(0.0, deadline - time.monotonic()))

    async def _stream(self, inp, prefill, decode, start, state, ctx) -> AsyncIterator[Delta]:
        m = self.metrics
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        stops = StopStringMatcher(inp.params.stop)
        completion = 0
        last = start
        sampling: generation_pb2.SamplingParams = sampling_to_proto(inp.params)
        stream = generate_pd(
            prefill.stub,
            decode.stub,
            inp.request_id,
            inp.prompt_ids,
            sampling,
            timeout_s=self.limits.request_timeout_s,
            handoff_timeout_s=self.limits.handoff_timeout_s,
            broker=self.registry.broker,
        )
        try:
            async for msg in _first_in_context(stream, ctx):
                now = time.monotonic()
                tokens = list(msg.token_ids)
                if tokens:
                    if state["waiting"]:
                        state["waiting"] = False
                        state["running"] = True
                        m.waiting.dec()
                        m.running.inc()
                        m.ttft.observe(now - start)
                    else:
                        for _ in tokens:
                            m.itl.observe((now - last) / len(tokens))
                    last = now
                    completion += len(tokens)
                    m.generated_tokens.inc(len(tokens))
                text = stops.feed(detok.push(tokens))
                if stops.stopped:
                    state["outcome"] = "stop"
                    m.e2e.observe(time.monotonic() - start)
                    yield Delta(tokens, text, "stop", len(inp.prompt_ids), completion)
                    return
                reason = msg.finish_reason or None
                if reason is not None:
                    text += stops.feed(detok.flush())
                    if stops.stopped:
                        reason = "stop"
                    else:
                        text += stops.flush()
                    state["outcome"] = reason
                    m.e2e.observe(time.monotonic() - start)
                    yield Delta(tokens, text, reason, len(inp.prompt_ids), completion)
                    return
                yield Delta(tokens, text, None, len(inp.prompt_ids), completion)
            raise GatewayError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        except PDError as exc:
            raise GatewayError(exc.code, exc.message) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        """Abort a running request: decode ends its stream with finish_reason "abort"."""
        pair = self.active.get(request_id)
        if pair is None:
            return False
        from dsmesh.v1 import generation_pb2 as g

        prefill, decode = pair
        req = g.AbortRequest(request_id=request_id)
        results = await asyncio.gather(
            decode.stub.Abort(req, timeout=5),
            prefill.stub.Abort(req, timeout=5),
            return_exceptions=True,
        )
        return any(getattr(r, "aborted", False) for r in results)


async def _first_in_context(stream: AsyncIterator, ctx: Context) -> AsyncIterator:
    """Advance ``stream`` the first time with ``ctx`` current: generate_pd starts its two
    calls then, so they (and everything downstream) join the request's trace."""
    with telemetry.attached(ctx):
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
    yield first
    async for item in stream:
        yield item
