"""The gateway's request pipeline, shared by gRPC, REST and the OpenAI routes.

validate + tokenise -> admission (wait in the queue until a target has room) -> run it on a
(prefill, decode) pair or a unified instance -> detokenise incrementally, apply stop strings
-> stream deltas. No protocol code here: callers convert.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from dsmesh.clients.pd import PDError, generate_pd, generate_unified
from dsmesh.engine.errors import InvalidRequestError, check_prompt
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer
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
from dsmesh.gateway.registry import Instance, InstanceRegistry
from dsmesh.gateway.routing import Target, largest_request_tokens
from dsmesh.gateway.stop_strings import OutputText
from dsmesh.runtime import telemetry
from dsmesh.runtime.convert import logprobs_from_proto, sampling_to_proto
from dsmesh.v1 import decode_pb2, generation_pb2, prefill_pb2

if TYPE_CHECKING:
    from dsmesh.gateway.choices import ChoiceGroup

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
    """A validated request. With ``prompt_only`` (the client asked for 0 new tokens) the
    instance still samples one token (the engine finishes a request on a token, and a PD
    handoff commits one), which the gateway drops: the client gets no token, finish_reason
    "length", and the prompt logprobs if it asked for them."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_only: bool = False


@dataclass(frozen=True)
class Delta:
    """One message to the client: new tokens, their text, and the end when it comes."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache, as the instance reported
    # one per token_ids entry when the request asks for logprobs (sampling.logprobs), else None
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which of the request's choices (n > 1, dsmesh/gateway/choices.py)
    # on the first delta, when the request asks for prompt logprobs: one per prompt token
    # after the first (SamplingParams.prompt_logprobs), else None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # speculative decoding: (drafted, accepted, verifications) of the request so far, as the
    # decoding instance reported them; None when it does not speculate
    spec: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class CoreLimits:
    request_timeout_s: float = 600.0
    handoff_timeout_s: float = 30.0
    route_wait_s: float = 5.0  # how long requests wait while no instance can serve at all
    max_inflight: int = 512  # requests dispatched to instances at most; more wait in the queue
    max_queued: int = 1024  # requests waiting in the queue at most; more get 429
    # KV-aware routing: what a cached prompt token weighs against a token of load; 0: off
    kv_routing_weight: float = 1.0


@dataclass(frozen=True)
class Placement:
    """Where an admitted request runs: ``prefill`` is None on a unified instance."""

    decode: Instance  # the decode or unified instance: it streams the tokens
    prefill: Instance | None
    # the request's id at the instances when not the client's: a request put back in the
    # queue (Gateway._requeues) gets one per attempt, since the refused attempt's id stays
    # taken there (kv_broker's tombstone) after its handoff ended
    call_id: str = ""


class _AbortedInQueue(Exception):
    """The Abort RPC took a request out of the queue."""


_ADMISSION_CODES = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unroutable: grpc.StatusCode.UNAVAILABLE,
}


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
        self.admission = AdmissionQueue(
            limits.max_inflight, limits.max_queued, limits.kv_routing_weight
        )
        # request_id -> where it runs; None while it waits for admission
        self.active: dict[str, Placement | None] = {}
        # a request of n > 1 choices (dsmesh/gateway/choices.py): its id -> its choices, so that
        # Abort with the client's id reaches them all
        self.choice_groups: dict[str, ChoiceGroup] = {}
        self._queued: dict[str, asyncio.Future[Placement]] = {}
        # requests aborted between leaving the queue and their first call to an instance
        # (admitted, or put back after a refusal): they end "abort" before that call
        self._aborted_unplaced: set[str] = set()
        registry.on_update.append(self._pump)

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
        span); the request's spans hang below it."""
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
        try:
            requeued = 0
            while True:
                try:
                    placed = await self._admit(inp, ctx, first=requeued > 0)
                except _AbortedInQueue:
                    state["outcome"] = "abort"
                    yield Delta([], "", "abort", len(inp.prompt_ids), 0)
                    return
                if requeued:
                    placed = dataclasses.replace(
                        placed, call_id=f"{inp.request_id}~requeued-{requeued}"
                    )
                self.active[inp.request_id] = placed
                if inp.request_id in self._aborted_unplaced:
                    state["outcome"], state["held"] = "abort", False  # no instance saw it
                    yield Delta([], "", "abort", len(inp.prompt_ids), 0)
                    return
                if not requeued:
                    m.prompt_tokens.inc(len(inp.prompt_ids))
                if placed.prefill is None:
                    span.set_attribute("dsmesh.unified", placed.decode.instance_id)
                else:
                    span.set_attribute("dsmesh.prefill", placed.prefill.instance_id)
                    span.set_attribute("dsmesh.decode", placed.decode.instance_id)
                sent = False
                try:
                    async for delta in self._stream(inp, placed, start, state, ctx):
                        sent = True
                        yield delta
                    return
                except GatewayError as exc:
                    if sent or not self._requeues(exc, start):
                        raise
                    refusal = exc.message
                # Refused for room before any work: back to the head of the queue.
                self.active[inp.request_id] = None
                self.admission.release(inp.request_id, time.monotonic(), held=False)
                m.requeued.inc()
                span.add_event("gateway.requeued", {"dsmesh.reason": refusal})
                requeued += 1
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
            self._pump()  # what it held may let the next one in
            if state["waiting"]:
                m.waiting.dec()
            if state["running"]:
                m.running.dec()
            m.requests.labels(state["outcome"]).inc()

    def _requeues(self, exc: GatewayError, start: float) -> bool:
        """Whether a request whose instance answered ``exc`` before sending anything waits in
        the queue again: the instance refused it for room (RESOURCE_EXHAUSTED: nothing ran,
        no page is held), and its time in the gateway (``--request-timeout``) is not over.
        A mesh that accepted a request does not refuse it later for a burst."""
        return (
            exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and time.monotonic() - start < self.limits.request_timeout_s
        )

    async def _admit(self, inp: GenerationInput, ctx: Context, first: bool = False) -> Placement:
        """Wait until the admission queue hands this request a target; raises GatewayError
        (RESOURCE_EXHAUSTED when the queue is full, INVALID_ARGUMENT when no instance could
        ever hold it, UNAVAILABLE when no instance can serve for ``route_wait_s``,
        DEADLINE_EXCEEDED after ``request_timeout_s`` in the queue)."""
        prompt = len(inp.prompt_ids)
        total = min(prompt + inp.params.max_new_tokens, self.model_config.max_position_embeddings)
        pages = PromptPages(inp.prompt_ids) if self.limits.kv_routing_weight > 0 else None
        ticket = Ticket(inp.request_id, prompt, total, pages)
        try:
            target = self.admission.submit(
                ticket, self.registry.loads(), time.monotonic(), first=first
            )
        except AdmissionError as exc:
            raise _gateway_error(exc) from None
        if target is not None:
            return self._place(target)
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self._queued[inp.request_id] = future
        self.metrics.queued.inc()
        try:
            with telemetry.tracer().start_as_current_span("gateway.queue", context=ctx):
                return await asyncio.wait_for(future, self.limits.request_timeout_s)
        except TimeoutError:
            raise GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"waited {self.limits.request_timeout_s:g} s in the gateway queue",
            ) from None
        finally:
            self._queued.pop(inp.request_id, None)
            self.metrics.queued.dec()

    def _pump(self) -> None:
        """Hand targets to waiting requests that fit now (after a poll, or a request ended)."""
        pumped = self.admission.pump(
            self.registry.loads(), time.monotonic(), self.limits.route_wait_s
        )
        for ticket, target in pumped.dispatched:
            future = self._queued.get(ticket.request_id)
            if future is None or future.done():  # gone already: give the target back
                self.admission.release(ticket.request_id, time.monotonic(), held=False)
                continue
            try:
                future.set_result(self._place(target))
            except GatewayError as exc:
                self.admission.release(ticket.request_id, time.monotonic(), held=False)
                future.set_exception(exc)
        for ticket, error in pumped.failed:
            future = self._queued.get(ticket.request_id)
            if future is not None and not future.done():
                future.set_exception(_gateway_error(error))

    def _place(self, target: Target) -> Placement:
        decode = self.registry.instances.get(target.instance_id)
        prefill = (
            None if target.prefill_id is None else self.registry.instances.get(target.prefill_id)
        )
        if decode is None or (target.prefill_id is not None and prefill is None):
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the chosen instance just left")
        self.metrics.routing.labels(target.reason).inc()
        return Placement(decode, prefill)

    async def _stream(
        self, inp: GenerationInput, placed: Placement, start: float, state: dict, ctx: Context
    ) -> AsyncIterator[Delta]:
        m = self.metrics
        output = OutputText(self.tokenizer, inp.params.stop, inp.params.min_tokens)
        completion = 0
        cached = 0  # prompt tokens the instance that prefilled it found in its prefix cache
        spec: tuple[int, int, int] | None = None  # the decoding instance's speculation counts
        wants_prompt = inp.params.prompt_logprobs is not None
        scored: list[TokenLogprobs] | None = None  # prompt logprobs, not handed over yet
        last = start
        sampling: generation_pb2.SamplingParams = sampling_to_proto(inp.params)
        call_id = placed.call_id or inp.request_id
        if placed.prefill is None:
            stream = generate_unified(
                placed.decode.stub,  # type: ignore[arg-type]
                call_id,
                inp.prompt_ids,
                sampling,
                timeout_s=self.limits.request_timeout_s,
            )
        else:

            def on_prefilled(answer: prefill_pb2.PrefillResponse) -> None:
                nonlocal cached, scored
                cached = answer.cached_tokens
                if wants_prompt:  # prefill computed them: they come with its answer
                    scored = [logprobs_from_proto(lp) for lp in answer.prompt_logprobs]
                self.admission.prefilled(inp.request_id)  # left prefill's queue: the next
                self._pump()  # may go there
                self.metrics.kv_handoff(answer)

            stream = generate_pd(
                placed.prefill.stub,  # type: ignore[arg-type]
                placed.decode.stub,  # type: ignore[arg-type]
                call_id,
                inp.prompt_ids,
                sampling,
                timeout_s=self.limits.request_timeout_s,
                handoff_timeout_s=self.limits.handoff_timeout_s,
                broker=self.registry.broker,
                on_prefilled=on_prefilled,
                prefill_first=wants_prompt,  # the first delta carries the prompt logprobs
            )
        try:

            def on_start() -> None:  # from now on, load reports account for the request
                self.admission.started(inp.request_id, time.monotonic())

            first = True
            async for msg in _first_in_context(stream, ctx, on_start):
                now = time.monotonic()
                tokens = list(msg.token_ids)
                logprobs = _logprobs(msg, inp.params)
                prompt_lps = None
                if first and wants_prompt:
                    if placed.prefill is None:  # a unified instance sends them in its stream
                        scored = [logprobs_from_proto(lp) for lp in msg.prompt_logprobs]
                    prompt_lps = _prompt_logprobs(scored, inp, msg.finish_reason)
                first = False
                if inp.prompt_only:  # the token the instance had to sample is not the client's
                    tokens = []
                    logprobs = None if logprobs is None else []
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
                if placed.prefill is None:
                    cached = msg.cached_tokens  # a unified instance reports it in its stream
                if msg.HasField("spec"):
                    spec = (msg.spec.draft_tokens, msg.spec.accepted_tokens, msg.spec.verifications)
                # a stop token id ends the output but, as in vLLM, its text is not shown
                shown = tokens
                stop_id = msg.finish_reason == "stop" and bool(tokens)
                if stop_id and tokens[-1] in inp.params.stop_token_ids:
                    shown = tokens[:-1]
                text = output.push(shown)
                if output.stopped:
                    state["outcome"] = "stop"
                    m.e2e.observe(time.monotonic() - start)
                    m.cached_tokens.inc(cached)
                    yield Delta(
                        tokens,
                        text,
                        "stop",
                        len(inp.prompt_ids),
                        completion,
                        cached,
                        logprobs,
                        prompt_logprobs=prompt_lps,
                        spec=spec,
                    )
                    return
                reason = msg.finish_reason or None
                if inp.prompt_only and reason == "stop":
                    reason = "length"  # it asked for no token, and got none
                if reason is not None:
                    text += output.finish()
                    if output.stopped:
                        reason = "stop"
                    state["outcome"] = reason
                    m.e2e.observe(time.monotonic() - start)
                    m.cached_tokens.inc(cached)
                    yield Delta(
                        tokens,
                        text,
                        reason,
                        len(inp.prompt_ids),
                        completion,
                        cached,
                        logprobs,
                        prompt_logprobs=prompt_lps,
                        spec=spec,
                    )
                    return
                yield Delta(
                    tokens,
                    text,
                    None,
                    len(inp.prompt_ids),
                    completion,
                    cached,
                    logprobs,
                    prompt_logprobs=prompt_lps,
                    spec=spec,
                )
            raise GatewayError(grpc.StatusCode.INTERNAL, "decode stream ended without a finish")
        except PDError as exc:
            raise GatewayError(exc.code, exc.message) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        """Abort a request: one still in the queue leaves it, one running is aborted where it
        runs; either way its stream ends with finish_reason "abort"."""
        future = self._queued.get(request_id)
        if future is not None and self.admission.is_waiting(request_id):
            self.admission.release(request_id, time.monotonic())
            if not future.done():
                future.set_exception(_AbortedInQueue())
            return True
        if request_id not in self.active:
            return False
        placed = self.active[request_id]
        if placed is None:  # admitted, its coroutine not yet resumed; or between attempts
            self._aborted_unplaced.add(request_id)
            return True
        from dsmesh.v1 import generation_pb2 as g

        req = g.AbortRequest(request_id=placed.call_id or request_id)
        calls = [placed.decode.stub.Abort(req, timeout=5)]
        if placed.prefill is not None:
            calls.append(placed.prefill.stub.Abort(req, timeout=5))
        results = await asyncio.gather(*calls, return_exceptions=True)
        return any(getattr(r, "aborted", False) for r in results)


def _logprobs(msg: decode_pb2.DecodeResponse, params: SamplingParams) -> list[TokenLogprobs] | None:
    """The message's logprobs, one per token, when the request asks for them."""
    if params.logprobs is None:
        return None
    if len(msg.logprobs) != len(msg.token_ids):
        raise GatewayError(
            grpc.StatusCode.INTERNAL,
            f"the instance sent {len(msg.logprobs)} logprobs for {len(msg.token_ids)} tokens",
        )
    return [logprobs_from_proto(lp) for lp in msg.logprobs]


def _prompt_logprobs(
    scored: list[TokenLogprobs] | None, inp: GenerationInput, finish_reason: str
) -> list[TokenLogprobs]:
    """The prompt logprobs the request's first delta carries: one per prompt token after the
    first (none when it was aborted before its prompt ran)."""
    expected = len(inp.prompt_ids) - 1
    if finish_reason == "abort" and not scored:
        return []
    if scored is None or len(scored) != expected:
        got = "none" if scored is None else len(scored)
        raise GatewayError(
            grpc.StatusCode.INTERNAL,
            f"the instance sent {got} prompt logprobs for {expected} prompt tokens",
        )
    return scored


def _gateway_error(exc: AdmissionError) -> GatewayError:
    if isinstance(exc, TooLarge):
        return invalid(exc.field, str(exc))
    return GatewayError(_ADMISSION_CODES.get(type(exc), grpc.StatusCode.UNAVAILABLE), str(exc))


async def _first_in_context(
    stream: AsyncIterator, ctx: Context, on_start: Callable[[], None]
) -> AsyncIterator:
    """Advance ``stream`` the first time with ``ctx`` current: generate_pd (or
    generate_unified) starts its calls then, so they (and everything downstream) join the
    request's trace. ``on_start`` runs just before: the calls begin at that moment."""
    with telemetry.attached(ctx):
        on_start()
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
    yield first
    async for item in stream:
        yield item
