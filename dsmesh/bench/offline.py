"""``dsmesh bench --backend offline``: the same load against the offline engine in-process,
the baseline that shows what the mesh (gateway + PD + transfers) adds to TTFT and ITL."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator

from dsmesh.bench.backends import Backend, RequestError
from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine, StepOutput
from dsmesh.engine.options import resolve_model_dir
from dsmesh.engine.request import Request
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.instance.worker import EngineWorker, drain_outputs
from dsmesh.runtime.convert import sampling_from_proto, spec_to_proto
from dsmesh.v1 import generation_pb2 as pb


class OfflineBackend(Backend):
    """One LLMEngine on its own thread, fed like the services feed theirs. ``config``: the
    engine's (None = defaults: the tiny model), e.g. the flags the mesh's instances get."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model_dir = str(resolve_model_dir(config.model))
        self.config = dataclasses.replace(config, model=self.model_dir)
        self.worker: EngineWorker | None = None
        self.tokenizer: Tokenizer | None = None
        self._ids = itertools.count()

    async def connect(self, timeout_s: float) -> None:
        engine = await asyncio.to_thread(LLMEngine, self.config)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.worker = EngineWorker(engine, name="bench-offline")
        self.worker.start()

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        assert self.worker is not None and self.tokenizer is not None
        worker = self.worker
        loop = asyncio.get_running_loop()
        streams: list[asyncio.Queue[StepOutput]] = []
        requests: list[Request] = []
        rid = f"offline-{next(self._ids)}"
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as exc:
            raise RequestError(f"INVALID_ARGUMENT: {exc}") from exc
        ids = list(request.input_ids) or self.tokenizer.encode(request.text)

        def submit(engine: LLMEngine) -> None:
            engine.add_request(ids, params, request_id=rid)
            requests.append(engine.requests[rid])
            streams.append(worker.stream(rid, loop))

        try:
            await worker.call(submit)
        except InvalidRequestError as exc:
            raise RequestError(f"INVALID_ARGUMENT: {exc}") from exc
        count = 0
        spec = None  # speculation counts so far
        try:
            while True:
                first = await asyncio.wait_for(streams[0].get(), timeout_s)
                out = drain_outputs(first, streams[0])
                spec = out.spec_counts or spec
                if not out.new_token_ids and not out.finished:
                    continue  # a prompt chunk without a token yet
                count += len(out.new_token_ids)
                msg = pb.GenerateResponse(
                    request_id=rid,
                    token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason or "",
                )
                msg.usage.prompt_tokens = len(ids)
                msg.usage.completion_tokens = count
                # set on the engine thread at admission, before any token was delivered
                msg.usage.cached_tokens = requests[0].num_cached_prompt_tokens or 0
                if spec is not None:
                    msg.usage.spec.CopyFrom(spec_to_proto(spec))
                yield msg
                if out.finished:
                    return
        finally:
            await worker.call(lambda e: worker.abort_request(e, rid))

    async def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
