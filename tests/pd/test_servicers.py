"""PrefillServicer and DecodeServicer built as their services build them, in one process: a
real kv_broker on loopback, a tiny engine per side, their gRPC servers on loopback, and KV
moved by a transport that copies between the two pools in memory. No child processes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from dsmesh.clients.broker import BrokerLink
from dsmesh.clients.pd import PDError, generate_pd
from dsmesh.decode_svc.handoff import DecodeHandoffs, HandoffEnd
from dsmesh.decode_svc.servicer import DecodeLimits, DecodeServicer
from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.request import RequestStatus
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.failures import Code
from dsmesh.instance.layout import layout_of
from dsmesh.instance.worker import EngineWorker
from dsmesh.prefill_svc.servicer import PrefillLimits, PrefillServicer
from dsmesh.runtime.grpc_server import channel, start_server
from dsmesh.runtime.transfer import KVTransport, RemotePool, pool_segments
from dsmesh.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from tests.kv_broker.conftest import running_broker

pytestmark = pytest.mark.timeout(120)

ENGINE = EngineConfig(page_size=16, max_total_tokens=4096, max_batch_tokens=32, device="cpu")


class MemoryTransport(KVTransport):
    """Copies pages between pools of this process (a test stand-in for Mooncake)."""

    def __init__(self, signature: str = "memory/copy", write_s: float = 0.0) -> None:
        self._signature = signature
        self._pools: dict[int, MLAKVPool] = {}
        self.write_s = write_s  # each write takes this long: a slow link

    @property
    def session_id(self) -> str:
        return "memory:0"

    @property
    def signature(self) -> str:
        return self._signature

    def register_pool(self, pool: MLAKVPool) -> RemotePool:
        ptr = pool.buffer.data_ptr()
        self._pools[ptr] = pool
        return RemotePool(self.session_id, ptr, pool.num_pages, pool.page_bytes, pool.num_layers)

    def write_pages(
        self, pool: MLAKVPool, remote: RemotePool, local_pages: list[int], remote_pages: list[int]
    ) -> int:
        pool_segments(pool, remote, local_pages, remote_pages)  # the checks a real one makes
        time.sleep(self.write_s)
        target = self._pools[remote.base_ptr].buffer
        target[:, remote_pages] = pool.buffer[:, local_pages]
        return len(local_pages) * pool.page_bytes * pool.num_layers

    def close(self) -> None:
        self._pools.clear()


@dataclass
class Pair:
    prefill: PrefillServicer
    decode: DecodeServicer
    prefill_stub: prefill_pb2_grpc.PrefillStub
    decode_stub: decode_pb2_grpc.DecodeStub
    broker: kb_grpc.KVBrokerStub

    async def pages_free(self, within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while True:
            d = await self.decode_stub.GetLoad(prefill_pb2.LoadRequest())
            p = await self.prefill_stub.GetLoad(prefill_pb2.LoadRequest())
            if d.free_pages == d.total_pages and p.free_pages == p.total_pages:
                return
            assert time.monotonic() < deadline, (d, p)
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving_pair(
    decode_signature: str = "memory/copy",
    write_s: float = 0.0,
    handoff_timeout_s: float = 10.0,
    progress_refresh_s: float = 2.0,
    reserve_wait_s: float = 2.0,
) -> AsyncIterator[Pair]:
    """kv_broker, then a prefill and a decode servicer built complete, each behind its own
    gRPC server and attached to the broker through its link. Each KV write takes
    ``write_s``."""
    async with running_broker() as broker, contextlib.AsyncExitStack() as stack:
        engines = await asyncio.gather(
            asyncio.to_thread(LLMEngine, ENGINE), asyncio.to_thread(LLMEngine, ENGINE)
        )
        transport = MemoryTransport(write_s=write_s)
        workers = [EngineWorker(engine) for engine in engines]
        for worker in workers:
            worker.start()
            stack.callback(worker.stop)
        p_engine, d_engine = engines
        d_pool = transport.register_pool(d_engine.kv_pool)
        transport.register_pool(p_engine.kv_pool)

        p_channel, d_channel = channel(broker.address), channel(broker.address)
        prefill = PrefillServicer(
            workers[0],
            kb_grpc.KVBrokerStub(p_channel),
            layout_of(p_engine, transport.signature),
            transport,
            PrefillLimits("p1", resolve_wait_s=5.0, progress_refresh_s=progress_refresh_s),
        )
        stack.callback(prefill.close)
        decode = DecodeServicer(
            workers[1],
            kb_grpc.KVBrokerStub(d_channel),
            layout_of(d_engine, decode_signature),
            d_pool,
            DecodeLimits("d1", handoff_timeout_s=handoff_timeout_s),
            DecodeHandoffs(reserve_wait_s=reserve_wait_s, release_quarantine_s=1.0),
        )
        links = [
            BrokerLink(
                broker.address,
                kb.Instance(instance_id="p1", role=kb.ROLE_PREFILL, transfer_session="memory:0"),
                on_event=prefill.on_broker_event,
                on_lost=[prefill.on_broker_lost],
                channel=p_channel,
            ),
            BrokerLink(
                broker.address,
                kb.Instance(instance_id="d1", role=kb.ROLE_DECODE, transfer_session="memory:0"),
                channel=d_channel,
            ),
        ]
        for link in links:
            link.start()
            stack.push_async_callback(link.close)
            assert await link.wait_attached(5)
        servers = [
            await start_server(
                lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, s),
                ["dsmesh.v1.Prefill"],
            ),
            await start_server(
                lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(decode, s),
                ["dsmesh.v1.Decode"],
            ),
        ]
        for server in servers:
            stack.push_async_callback(server.server.stop, None)
        stack.push_async_callback(prefill.drain)
        stack.push_async_callback(decode.drain)
        p_client, d_client = (channel(f"127.0.0.1:{s.port}") for s in servers)
        stack.push_async_callback(p_client.close)
        stack.push_async_callback(d_client.close)
        yield Pair(
            prefill,
            decode,
            prefill_pb2_grpc.PrefillStub(p_client),
            decode_pb2_grpc.DecodeStub(d_client),
            broker.stub,
        )


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 500, (length,), generator=g).tolist() for length in (5, 33, 70)][:n]


async def run(pair: Pair, rid: str, prompt: list[int], max_new: int) -> list[int]:
    tokens: list[int] = []
    sampling = generation_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    async for msg in generate_pd(pair.prefill_stub, pair.decode_stub, rid, prompt, sampling, 60):
        tokens += list(msg.token_ids)
    return tokens


def test_codes_are_named_as_grpc_names_them() -> None:
    assert {c.name for c in Code} == {c.name for c in grpc.StatusCode} - {"OK"}


def test_in_process_pair_matches_the_offline_engine() -> None:
    reference = LLMEngine(ENGINE)
    expected = [
        r.output_ids
        for r in reference.generate(
            prompts(3), [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3
        )
    ]

    async def main() -> list[list[int]]:
        async with serving_pair() as pair:
            got = await asyncio.gather(
                *[run(pair, f"ok-{i}", p, 6) for i, p in enumerate(prompts(3))]
            )
            await pair.pages_free()
            assert "ok-0" not in pair.decode.handoffs and not pair.prefill.jobs
            status = await pair.broker.Get(kb.HandoffRequest(request_id="ok-2"))
            assert (status.state, status.cause, status.prefill_released) == (
                kb.HANDOFF_DONE,
                kb.CAUSE_UNSPECIFIED,
                True,
            )
            return got

    assert asyncio.run(main()) == expected


@pytest.mark.parametrize("refresh", [True, False])
def test_handoffs_waiting_behind_slow_writes_keep_their_deadlines_ahead(refresh: bool) -> None:
    """Eight prompts share one lane whose writes take 0.2 s each (about 5 s in all) under a
    1 s handoff timeout. While writes land, the handoffs waiting behind them report again
    and all eight serve the offline engine's tokens; without those reports (a refresh period
    longer than the run), a handoff still waiting a second after its Resolve times out."""
    ids = [p for p in prompts(3) for _ in range(3)][:8]
    reference = LLMEngine(ENGINE)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True)] * len(ids)
    expected = [r.output_ids for r in reference.generate(ids, params)]

    async def main() -> list[list[int] | PDError]:
        async with serving_pair(
            write_s=0.2, handoff_timeout_s=1.0, progress_refresh_s=0.1 if refresh else 1e9
        ) as pair:
            got = await asyncio.gather(
                *[run(pair, f"slow-{i}", p, 3) for i, p in enumerate(ids)],
                return_exceptions=True,
            )
            await pair.pages_free(within=15.0)
            return got  # type: ignore[return-value]

    got = asyncio.run(main())
    if refresh:
        assert got == expected
    else:
        failed = [g for g in got if isinstance(g, PDError)]
        assert failed and len(failed) + sum(g in expected for g in got) == len(ids), got
        assert all(f.code == grpc.StatusCode.DEADLINE_EXCEEDED for f in failed), failed
        assert all("HANDOFF_TIMED_OUT" in str(f) for f in failed), failed


def test_requests_in_line_are_reserved_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve requests arrive while decode's engine thread is busy (a 1 s command). The first
    reserves alone; the next in line then reserves for all eleven behind it in one engine
    command, not one per engine step (on the H200 that capped PD at about 35 requests/s).
    The request that asked for that command is cancelled while it runs: its pages still come
    back, and the others serve the offline engine's tokens."""
    import dsmesh.decode_svc.servicer as servicer

    lines: list[int] = []
    real = servicer._try_reserve_line
    calls: list[asyncio.Future[list[int]]] = []
    loop: list[asyncio.AbstractEventLoop] = []

    victim: list[int] = []

    def counted(engine: LLMEngine, line: list) -> tuple:
        lines.append(len(line))
        if len(line) > 1 and not victim:
            # The batch: cancel the request that asked for it (the first in line) and let the
            # cancel land. The next in line waits for this command's answer; it must not
            # reserve the same requests again (they would fail "already in use").
            victim.append(int(line[0].request_id.removeprefix("line-")))
            loop[0].call_soon_threadsafe(calls[victim[0]].cancel)
            time.sleep(0.3)
        return real(engine, line)

    monkeypatch.setattr(servicer, "_try_reserve_line", counted)
    ids = [p for p in prompts(3) for _ in range(4)]
    reference = LLMEngine(ENGINE)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True)] * len(ids)
    expected = [r.output_ids for r in reference.generate(ids, params)]

    async def main() -> list[list[int] | BaseException]:
        loop.append(asyncio.get_running_loop())
        async with serving_pair() as pair:
            busy = asyncio.ensure_future(pair.decode.worker.call(lambda e: time.sleep(1.0)))
            await asyncio.sleep(0.05)
            calls.extend(
                asyncio.ensure_future(run(pair, f"line-{i}", p, 3)) for i, p in enumerate(ids)
            )
            while pair.decode.handoffs.num_in_line < len(ids):
                await asyncio.sleep(0.005)
            await busy
            got = await asyncio.gather(*calls, return_exceptions=True)
            await pair.pages_free()
            assert f"line-{victim[0]}" not in pair.decode.handoffs
            return got

    got = asyncio.run(main())
    v = victim[0]
    assert isinstance(got[v], asyncio.CancelledError)
    assert [g for i, g in enumerate(got) if i != v] == [e for i, e in enumerate(expected) if i != v]
    assert lines[:2] == [1, 11], lines  # 12 requests: 2 engine commands, not 12


def test_a_line_reservation_that_outlasts_the_reserve_wait_serves_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine command reserving for the line runs past the requests' reserve wait. Each
    request waits for its answer and is served. Before, each gave up with RESOURCE_EXHAUSTED,
    and the pages the command granted it stayed taken for good (a flaky leak in CI)."""
    import dsmesh.decode_svc.servicer as servicer

    real = servicer._try_reserve_line

    def slow(engine: LLMEngine, line: list) -> tuple:
        if len(line) > 1:
            time.sleep(1.5)  # the line's deadlines pass meanwhile
        return real(engine, line)

    monkeypatch.setattr(servicer, "_try_reserve_line", slow)
    ids = prompts(3) * 2
    reference = LLMEngine(ENGINE)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True)] * len(ids)
    expected = [r.output_ids for r in reference.generate(ids, params)]

    async def main() -> list[list[int] | BaseException]:
        async with serving_pair(reserve_wait_s=1.0) as pair:
            busy = asyncio.ensure_future(pair.decode.worker.call(lambda e: time.sleep(0.3)))
            await asyncio.sleep(0.05)
            calls = [run(pair, f"slow-{i}", p, 3) for i, p in enumerate(ids)]
            got = await asyncio.gather(*calls, return_exceptions=True)
            await busy
            await pair.pages_free()
            return got

    assert asyncio.run(main()) == expected


def test_layout_mismatch_is_failed_precondition_on_both_sides() -> None:
    async def main() -> None:
        async with serving_pair(decode_signature="other/transport") as pair:
            sampling = generation_pb2.SamplingParams(max_new_tokens=4)
            request = {"request_id": "mismatch", "input_ids": prompts(1)[0], "sampling": sampling}
            decode_call = pair.decode_stub.Decode(decode_pb2.DecodeRequest(**request), timeout=30)
            prefill_call = pair.prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(**request), timeout=30
            )
            with pytest.raises(grpc.aio.AioRpcError) as prefill_err:
                await prefill_call
            with pytest.raises(grpc.aio.AioRpcError) as decode_err:
                async for _ in decode_call:
                    pass
            for err in (prefill_err.value, decode_err.value):
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
                assert "transport prefill=memory/copy decode=other/transport" in err.details()
            assert decode_err.value.details().startswith("KV handoff HANDOFF_FAILED: ")
            status = await pair.broker.Get(kb.HandoffRequest(request_id="mismatch"))
            assert (status.state, status.cause) == (kb.HANDOFF_FAILED, kb.CAUSE_LAYOUT_MISMATCH)
            await pair.pages_free()

    asyncio.run(main())


def test_client_cancel_while_decoding_frees_both_sides() -> None:
    async def main() -> None:
        async with serving_pair() as pair:
            sampling = generation_pb2.SamplingParams(max_new_tokens=500, ignore_eos=True)
            stream = generate_pd(
                pair.prefill_stub, pair.decode_stub, "cancel", prompts(2)[1], sampling, 60
            )
            got = 0
            async for msg in stream:
                got += len(msg.token_ids)
                if got >= 2:
                    break
            await stream.aclose()
            await pair.pages_free(within=2.0)
            assert "cancel" not in pair.decode.handoffs

    asyncio.run(main())


def test_abort_before_the_reservation_is_cancelled_at_once() -> None:
    async def main() -> None:
        async with serving_pair() as pair:
            await pair.broker.Abort(kb.HandoffRequest(request_id="early"))
            start = time.monotonic()
            with pytest.raises(PDError) as err:
                await run(pair, "early", prompts(1)[0], 4)
            assert time.monotonic() - start < 5
            assert err.value.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
            await pair.pages_free()

    asyncio.run(main())


def test_an_abort_between_the_handoff_and_the_activation_ends_the_request() -> None:
    """The handoff ends DONE; decode's Abort comes while the request holds its reserved pages
    and has not joined the running batch yet (its activation is held back here until the
    Abort answered). The Abort still reaches it: the stream ends "abort" with no token, not
    "length", and every page comes back."""

    async def main() -> None:
        async with serving_pair() as pair:
            real = pair.decode._await_end
            ended, go = asyncio.Event(), asyncio.Event()

            async def held(rid: str) -> HandoffEnd:
                end = await real(rid)
                ended.set()
                await go.wait()
                return end

            pair.decode._await_end = held  # type: ignore[method-assign]
            sampling = generation_pb2.SamplingParams(max_new_tokens=64, ignore_eos=True)
            stream = generate_pd(
                pair.prefill_stub, pair.decode_stub, "late", prompts(2)[1], sampling, 60
            )
            messages = asyncio.ensure_future(_collect(stream))
            await ended.wait()
            status = await pair.broker.Get(kb.HandoffRequest(request_id="late"))
            assert status.state == kb.HANDOFF_DONE
            state = await pair.decode.worker.call(lambda e: e.get("late").status)
            assert state is RequestStatus.RESERVED
            answer = await pair.decode_stub.Abort(generation_pb2.AbortRequest(request_id="late"))
            assert answer.aborted
            go.set()
            got = await asyncio.wait_for(messages, 30)
            assert [(list(m.token_ids), m.finish_reason) for m in got] == [([], "abort")]
            await pair.pages_free()
            assert "late" not in pair.decode.handoffs
            assert await pair.decode.worker.call(lambda e: e.get("late")) is None

    asyncio.run(main())


def test_prefill_unreachable_before_decode_registered_fails_the_handoff() -> None:
    """Prefill cannot be reached while decode's engine is still reserving the request's pages
    (busy here), so kv_broker has no handoff yet. The PD client fails it there before it
    cancels decode's call: the record ends FAILED for PREFILL_UNREACHABLE (not missing, nor
    ABORTED by decode's cancelled call), and decode's pages come back."""

    async def main() -> None:
        async with serving_pair() as pair:
            with socket.socket() as s:  # a port that nothing listens on
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dead = channel(f"127.0.0.1:{port}")
            gate = threading.Event()
            busy = asyncio.ensure_future(pair.decode.worker.call(lambda e: gate.wait(10)))
            try:
                sampling = generation_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
                stream = generate_pd(
                    prefill_pb2_grpc.PrefillStub(dead),
                    pair.decode_stub,
                    "lost",
                    prompts(1)[0],
                    sampling,
                    60,
                    broker=pair.broker,
                )
                with pytest.raises(PDError) as err:
                    await _collect(stream)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert err.value.message.startswith("prefill: ")
            finally:
                gate.set()
                await busy
                await dead.close()
            status = await pair.broker.Get(kb.HandoffRequest(request_id="lost"))
            assert (status.state, status.cause, status.prefill_released) == (
                kb.HANDOFF_FAILED,
                kb.CAUSE_PREFILL_UNREACHABLE,
                True,
            )
            assert status.message.startswith("prefill unreachable: ")
            await pair.pages_free()
            while "lost" in pair.decode.handoffs:
                await asyncio.sleep(0.01)

    asyncio.run(main())


async def _collect(stream: AsyncIterator[decode_pb2.DecodeResponse]) -> list:
    return [msg async for msg in stream]


def test_a_duplicate_id_is_refused_and_the_first_call_unharmed() -> None:
    async def main() -> None:
        async with serving_pair() as pair:
            sampling = generation_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
            first = asyncio.ensure_future(run(pair, "dup", prompts(3)[2], 4))
            while "dup" not in pair.decode.handoffs:
                await asyncio.sleep(0.005)
            again = pair.decode_stub.Decode(
                decode_pb2.DecodeRequest(request_id="dup", input_ids=[1, 2], sampling=sampling)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in again:
                    pass
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert err.value.details() == "request dup is already active"
            assert len(await first) == 4
            await pair.pages_free()

    asyncio.run(main())
