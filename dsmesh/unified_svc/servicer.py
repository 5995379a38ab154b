"""dsmesh.v1.Decode on a unified instance: the whole request (prompt and sampling) runs here,
prefilled in chunks mixed into the decode batches, and its tokens stream back. No handoff."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import LLMEngine, StepOutput
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.instance.failures import already_active
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.prefixes import prefix_digest
from dsmesh.instance.rpc import parse_request, server_stream, unary
from dsmesh.instance.worker import EngineWorker, drain_outputs
from dsmesh.runtime.background import BackgroundTasks
from dsmesh.runtime.convert import logprobs_to_proto, spec_to_proto
from dsmesh.unified_svc.load import unified_load
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2


class UnifiedServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self, worker: EngineWorker, instance_id: str, metrics: InstanceMetrics | None = None
    ) -> None:
        self.worker = worker
        self.instance_id = instance_id
        self.metrics = metrics
        self.active: set[str] = set()  # request ids streaming, or whose pages are being freed
        self._background = BackgroundTasks()

    @server_stream
    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid, params = parse_request(request)
        if rid in self.active:
            raise already_active(rid)
        self.active.add(rid)  # claimed before the first await: a concurrent duplicate is refused
        prompt = list(request.input_ids)
        loop = asyncio.get_running_loop()
        streams: list[asyncio.Queue[StepOutput]] = []
        requests: list[Request] = []

        def submit(engine: LLMEngine) -> None:
            engine.add_request(prompt, params, request_id=rid)
            requests.append(engine.requests[rid])
            streams.append(self.worker.stream(rid, loop))

        settled = False  # nothing left in the engine: finished, or never queued
        try:
            try:
                await self.worker.call(submit)
            except InvalidRequestError:  # e.g. larger than the whole KV pool
                settled = True
                raise
            completion = 0
            spec: tuple[int, int, int] | None = None  # speculation counts so far
            scored: list[TokenLogprobs] = []  # prompt logprobs not sent yet
            while not settled:
                out = drain_outputs(await streams[0].get(), streams[0])
                spec = out.spec_counts or spec
                scored += out.prompt_logprobs or ()
                if not out.new_token_ids and not out.finished:
                    continue  # a prompt chunk: no token yet
                if completion == 0 and self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(prompt))
                completion += len(out.new_token_ids)
                if self.metrics is not None:
                    self.metrics.generated_tokens.inc(len(out.new_token_ids))
                settled = out.finished
                # set on the engine thread at admission, before any token was delivered
                cached = requests[0].num_cached_prompt_tokens or 0
                yield decode_pb2.DecodeResponse(
                    request_id=rid,
                    token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason or "",
                    prompt_tokens=len(prompt),
                    completion_tokens=completion,
                    cached_tokens=cached,
                    logprobs=[logprobs_to_proto(lp) for lp in out.logprobs or ()],
                    prompt_logprobs=[logprobs_to_proto(lp) for lp in scored],
                    spec=spec_to_proto(spec),
                )
                scored = []
        finally:
            if settled:
                self.active.discard(rid)
            else:  # the client went away: abort in the engine (after a pending submit, FIFO)
                self._background.spawn(self._abort_then_forget(rid))

    async def _abort_then_forget(self, rid: str) -> None:
        try:
            await self.worker.call(lambda e: self.worker.abort_request(e, rid))
        finally:
            self.active.discard(rid)  # the id stays taken until its pages are free

    async def drain(self) -> None:
        await self._background.drain()

    @unary
    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        """Stop a request; its stream ends with finish_reason "abort" and its pages are free."""
        rid = request.request_id
        aborted = await self.worker.call(lambda e: self.worker.abort_request(e, rid))
        return generation_pb2.AbortResponse(aborted=aborted)

    @unary
    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.DecodeLoad:
        engine_load, prefixes = await self.worker.call(
            lambda e: (e.load(), prefix_digest(e, request))
        )
        load = unified_load(engine_load)
        return decode_pb2.DecodeLoad(
            instance_id=self.instance_id,
            free_pages=load.free_pages,
            total_pages=load.total_pages,
            running_requests=load.running_requests,
            waiting_handoffs=load.waiting_requests,
            page_size=self.worker.engine.config.page_size,
            max_running_requests=self.worker.engine.config.max_running_requests,
            prefixes=prefixes,
        )
