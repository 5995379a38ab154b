"""A unified instance on its own (dsmesh.v1.Decode called directly): greedy tokens equal the
offline engine, aborts and cancels free every page, bad input is INVALID_ARGUMENT naming the
field, it registers with kv_broker as ROLE_UNIFIED, its load counts what waits in its engine,
and SIGTERM lets an in-flight stream finish."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.engine.kv.pool import PageAllocator
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sched.load_report import engine_load
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.unified_svc.load import unified_load
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from tests.unified.conftest import SMALL_BATCH_TOKENS, SMALL_POOL_TOKENS

pytestmark = pytest.mark.timeout(180)

PAGE = 16
GREEDY = generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=24)


def prompt(length: int, salt: int) -> list[int]:
    return [3 + (i * 13 + salt * 7) % 500 for i in range(length)]


def request(rid: str, ids: list[int], sampling=GREEDY) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=rid, input_ids=ids, sampling=sampling)


async def decode(
    stub, rid: str, ids: list[int], sampling=GREEDY
) -> list[decode_pb2.DecodeResponse]:
    return [m async for m in stub.Decode(request(rid, ids, sampling), timeout=120)]


async def load(address: str) -> decode_pb2.DecodeLoad:
    async with channel(address) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).GetLoad(prefill_pb2.LoadRequest(), timeout=10)


async def wait_idle(address: str, timeout_s: float = 60.0) -> decode_pb2.DecodeLoad:
    """GetLoad once nothing runs or waits (cleanups run in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await load(address)
        if got.running_requests == 0 and got.free_pages == got.total_pages:
            return got
        if time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


def pages_used(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('dsmesh_kv_pages_used{role="unified"}'):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no dsmesh_kv_pages_used for role unified")


@pytest.fixture(scope="module")
def offline() -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu"))


def test_greedy_tokens_equal_the_offline_engine(small_mesh, offline) -> None:
    # prompts longer than one 64-token forward (chunked prefill mixed with decoding rows),
    # then the same prompts again: their full pages come from the prefix cache this time
    prompts = [prompt(n, n) for n in (5, 40, 100, 150, 17)]
    expected = offline.generate(prompts, SamplingParams(max_new_tokens=24))

    async def main() -> list[list[decode_pb2.DecodeResponse]]:
        async with channel(small_mesh.unified.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            first = await asyncio.gather(
                *(decode(stub, f"eq-{i}", p) for i, p in enumerate(prompts))
            )
            again = await asyncio.gather(
                *(decode(stub, f"eq-again-{i}", p) for i, p in enumerate(prompts))
            )
            return first + again

    runs = asyncio.run(main())
    for i, messages in enumerate(runs):
        ids, want = prompts[i % len(prompts)], expected[i % len(prompts)]
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == want.output_ids, i
        assert messages[0].token_ids, "the first message carries the first token"
        assert all(m.token_ids for m in messages)
        reasons = [m.finish_reason for m in messages]
        assert reasons == [""] * (len(messages) - 1) + [want.finish_reason]
        last = messages[-1]
        assert (last.prompt_tokens, last.completion_tokens) == (len(ids), len(tokens))
        counts = itertools.accumulate(len(m.token_ids) for m in messages)
        assert [m.completion_tokens for m in messages] == list(counts)
    assert {r.finish_reason for r in expected} == {"length", "stop"}  # both ends covered
    assert SMALL_BATCH_TOKENS < 150  # the long prompts were chunked
    assert pages_used(small_mesh.unified_metrics_port) == 0


def test_logprobs_and_penalties_equal_the_offline_engine(small_mesh, offline) -> None:
    ids = prompt(70, 3)  # longer than one forward: chunked, then sampled
    params = SamplingParams(
        max_new_tokens=10,
        ignore_eos=True,
        logprobs=2,
        frequency_penalty=0.8,
        seed=4,
        temperature=0.7,
        logit_bias=((9, 1.5),),
    )
    rid = offline.add_request(ids, params)
    tokens, logprobs = [], []
    while offline.has_unfinished():
        for out in offline.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.logprobs or []

    async def main() -> list[decode_pb2.DecodeResponse]:
        async with channel(small_mesh.unified.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            return await decode(stub, "logprobs-0", ids, sampling_to_proto(params))

    messages = asyncio.run(main())
    assert [t for m in messages for t in m.token_ids] == tokens
    got = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in got] == tokens
    assert [lp.logprob for lp in got] == pytest.approx([e.logprob for e in logprobs], abs=1e-4)
    assert all(len(lp.top) == 2 for lp in got)


def test_abort_and_cancel_free_every_page(small_mesh) -> None:
    address = small_mesh.unified.address
    endless = generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=900, ignore_eos=True)

    async def main() -> tuple:
        async with channel(address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            # 1. the client cancels after two messages
            call = stub.Decode(request("cancel-me", prompt(30, 1), endless), timeout=120)
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 2:
                    call.cancel()
                    break
            # 2. the Abort RPC ends a running stream with finish_reason "abort"
            call = stub.Decode(request("abort-me", prompt(30, 2), endless), timeout=120)
            got = [await anext(call.__aiter__())]
            aborted = await stub.Abort(generation_pb2.AbortRequest(request_id="abort-me"))
            got += [m async for m in call]
            unknown = await stub.Abort(generation_pb2.AbortRequest(request_id="no-such"))
            # 3. a client that goes away while its request still waits in the engine (the
            # pool holds one of these at a time: 1000 + 900 tokens of 2048)
            hog = stub.Decode(request("hog", prompt(1000, 3), endless), timeout=120)
            await anext(hog.__aiter__())
            waiter = stub.Decode(request("waiter", prompt(1000, 4), endless), timeout=120)
            waiting = await _until(
                lambda: load(address), lambda lo: lo.waiting_handoffs == 1 and lo.free_pages == 0
            )
            waiter.cancel()
            hog.cancel()
            idle = await wait_idle(address)
            return got, aborted, unknown, waiting, idle

    got, aborted, unknown, waiting, idle = asyncio.run(main())
    assert aborted.aborted and not unknown.aborted
    assert got[-1].finish_reason == "abort"
    # while "waiter" waited: both counted as running, its pages no longer counted free
    assert (waiting.running_requests, waiting.waiting_handoffs, waiting.free_pages) == (2, 1, 0)
    assert (idle.running_requests, idle.waiting_handoffs) == (0, 0)
    assert idle.free_pages == idle.total_pages == SMALL_POOL_TOKENS // PAGE
    assert idle.page_size == PAGE
    assert pages_used(small_mesh.unified_metrics_port) == 0


async def _until(read, ok, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if ok(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("rid", "ids", "sampling", "code", "field"),
    [
        ("", [5, 6], GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ("x" * 257, [5, 6], GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ("bad-1", [], GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "input_ids"),
        ("bad-2", [5, 10**6], GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "input_ids"),
        ("bad-3", [5] * 4096, GREEDY, grpc.StatusCode.INVALID_ARGUMENT, "input_ids"),
        (
            "bad-4",
            [5, 6],
            generation_pb2.SamplingParams(temperature=-1.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        (
            "bad-5",
            [5, 6],
            generation_pb2.SamplingParams(top_p=0.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (  # 100 + 3000 tokens: more than the whole 2048-token pool
            "too-large",
            [5] * 100,
            generation_pb2.SamplingParams(max_new_tokens=3000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_new_tokens",
        ),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    small_mesh, rid, ids, sampling, code, field
) -> None:
    async def main() -> grpc.aio.AioRpcError:
        async with channel(small_mesh.unified.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await decode(decode_pb2_grpc.DecodeStub(ch), rid, ids, sampling)
            return info.value

    err = asyncio.run(main())
    assert err.code() == code
    assert err.details().startswith(f"{field}: "), err.details()


def test_a_duplicate_live_request_id_is_already_exists(small_mesh) -> None:
    endless = generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=900, ignore_eos=True)

    async def main() -> grpc.aio.AioRpcError:
        async with channel(small_mesh.unified.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            first = stub.Decode(request("twice", prompt(8, 5), endless), timeout=120)
            await anext(first.__aiter__())
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await decode(stub, "twice", prompt(8, 6))
            finally:
                first.cancel()
            return info.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert asyncio.run(wait_idle(small_mesh.unified.address)).running_requests == 0


def test_attached_to_kv_broker_as_unified_and_serving(small_mesh) -> None:
    async def main():
        async with channel(small_mesh.broker.address) as ch:
            listed = await kb_grpc.KVBrokerStub(ch).ListInstances(kb.ListInstancesRequest())
        async with channel(small_mesh.unified.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="dsmesh.v1.Decode"), timeout=5
            )
        return listed, health

    listed, health = asyncio.run(main())
    [inst] = listed.instances
    assert inst.role == kb.ROLE_UNIFIED
    assert inst.grpc_address == small_mesh.unified.address
    assert inst.instance_id.startswith("unified-")
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_startup_phases_are_on_its_metrics(small_mesh) -> None:
    """dsmesh_startup_seconds: each phase of the process's start-up, in seconds (a unified
    instance has no transfer engine, so no ``transfer`` phase)."""
    url = f"http://127.0.0.1:{small_mesh.unified_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    prefix = 'dsmesh_startup_seconds{phase="'
    phases = {}
    for line in lines:
        if line.startswith(prefix):
            labels, value = line.rsplit(" ", 1)
            assert labels.endswith('",role="unified"}'), labels
            phases[labels[len(prefix) : labels.index('"', len(prefix))]] = float(value)
    assert list(phases) == ["imports", "weights", "kv_pool", "kernels", "graphs", "server"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["imports"] > 0 and phases["weights"] > 0  # torch alone takes a while


def test_load_counts_the_pages_of_requests_waiting_in_the_engine() -> None:
    scheduler = Scheduler(SchedulerConfig(page_size=PAGE), PageAllocator(100))

    def req(rid: str, prompt_tokens: int) -> Request:
        """Pages come on demand: admission takes the prompt's."""
        params = SamplingParams(max_new_tokens=64)
        return Request(rid, [1] * prompt_tokens, params, prompt_tokens + 64)

    running = req("running", 320)  # 20 pages
    assert scheduler.assign_pages(running)
    scheduler.running.append(running)
    for n in range(3):
        scheduler.add(req(f"waiting-{n}", 500))  # 32 pages each, none taken yet
    got = unified_load(engine_load(scheduler, 100))
    # 80 pages free in the allocator, but the first two waiting requests will take 64
    assert (got.free_pages, got.total_pages, got.running_requests, got.waiting_requests) == (
        0,
        100,
        4,
        3,
    )
    scheduler.waiting.pop()
    assert unified_load(engine_load(scheduler, 100)).free_pages == 80 - 64


def test_sigterm_lets_an_in_flight_stream_finish(small_mesh, tmp_path) -> None:
    # its own broker: the small mesh's gateway must not see this instance come and go
    broker = start_service("kv-broker", dsmesh_command("kv-broker", "--port", "0"))
    args = ("--broker", broker.address, "--dtype", "float32", "--port", "0")
    proc = start_service("unified", dsmesh_command("unified", *args), log_dir=tmp_path)
    try:

        async def main() -> list[decode_pb2.DecodeResponse]:
            async with channel(proc.address) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                call = stub.Decode(request("drained", prompt(12, 9)), timeout=120)
                messages = [await anext(call.__aiter__())]
                proc.process.send_signal(signal.SIGTERM)
                messages += [m async for m in call]
                return messages

        messages = asyncio.run(main())
        assert messages[-1].finish_reason == "length"
        assert messages[-1].completion_tokens == 24
        assert proc.process.wait(30) == 0
    finally:
        proc.stop()
        broker.stop()
