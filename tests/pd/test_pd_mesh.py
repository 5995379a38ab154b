"""Prefill + decode + kv_broker as real processes: outputs equal the offline engine's,
aborts at every stage free every page, layout mismatches are refused at the handshake."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from dsmesh.clients.pd import PDError, generate_pd
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import decode_pb2_grpc, generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def offline(mesh) -> LLMEngine:
    from dsmesh.engine.model.tiny_model import default_model_dir

    return LLMEngine(EngineConfig(model=str(default_model_dir()), max_total_tokens=1 << 16))


class Client:
    """Stubs for one (prefill, decode) pair and the broker, on one event loop."""

    def __init__(self, mesh, prefill_ps: int, decode_ps: int) -> None:
        self._channels = [
            channel(mesh.prefill[prefill_ps].address),
            channel(mesh.decode[decode_ps].address),
            channel(mesh.broker.address),
        ]
        self.prefill = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode = decode_pb2_grpc.DecodeStub(self._channels[1])
        self.broker = kb_grpc.KVBrokerStub(self._channels[2])

    async def run(self, rid: str, prompt: list[int], sampling) -> tuple[list[int], str]:
        tokens: list[int] = []
        reason = ""
        async for msg in generate_pd(self.prefill, self.decode, rid, prompt, sampling, 120):
            tokens += list(msg.token_ids)
            reason = msg.finish_reason or reason
        return tokens, reason

    async def pages_free(self) -> tuple[bool, str]:
        d = await self.decode.GetLoad(prefill_pb2.LoadRequest())
        p = await self.prefill.GetLoad(prefill_pb2.LoadRequest())
        ok = d.free_pages == d.total_pages and p.free_pages == p.total_pages
        return ok, f"decode {d.free_pages}/{d.total_pages}, prefill {p.free_pages}/{p.total_pages}"

    async def wait_pages_free(self, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            ok, detail = await self.pages_free()
            if ok:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"pages not freed within {within}s: {detail}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


def sampling(max_new: int, **kw) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_new_tokens=max_new, **kw)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 7, 16, 17, 31, 64, 97, 150, 257, 300, 420]
    return [
        torch.randint(0, 500, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_outputs_equal_offline_engine(mesh, offline, page_size: int) -> None:
    prompts = mixed_prompts(36, seed=page_size)
    max_new = [4 + (i * 5) % 13 for i in range(len(prompts))]
    params = [
        SamplingParams(max_new_tokens=m, ignore_eos=i % 3 != 0) for i, m in enumerate(max_new)
    ]
    expected = offline.generate(prompts, params)

    async def main() -> list:
        client = Client(mesh, page_size, page_size)
        try:
            results = await asyncio.gather(
                *[
                    client.run(
                        f"greedy-{page_size}-{i}",
                        p,
                        sampling(sp.max_new_tokens, ignore_eos=sp.ignore_eos),
                    )
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                ]
            )
            await client.wait_pages_free(5)
            return results
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, ((tokens, reason), ref) in enumerate(zip(results, expected, strict=True)):
        assert tokens == ref.output_ids, f"request {i} (prompt {len(prompts[i])} tokens)"
        assert reason == ref.finish_reason


def test_seeded_sampling_equals_offline_engine(mesh, offline) -> None:
    prompts = mixed_prompts(4, seed=99)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_new_tokens=10, ignore_eos=True)
        for i in range(4)
    ]
    expected = [r.output_ids for r in offline.generate(prompts, params)]

    async def main() -> list:
        client = Client(mesh, 16, 16)
        try:
            return await asyncio.gather(
                *[
                    client.run(
                        f"seeded-{i}",
                        p,
                        sampling(10, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True),
                    )
                    for i, p in enumerate(prompts)
                ]
            )
        finally:
            await client.close()

    assert [t for t, _ in asyncio.run(main())] == expected


def test_logprobs_and_penalties_cross_the_handoff(mesh, offline) -> None:
    """Prefill samples the first token: its logprobs reach decode through kv_broker and lead
    decode's stream; penalties on decode count it among the output. Everything equals the
    offline engine's."""
    prompts = mixed_prompts(3, seed=7)
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_new_tokens=8,
            ignore_eos=True,
            logprobs=0,
            frequency_penalty=1.5,
            repetition_penalty=1.3,
            logit_bias=((5, 2.0),),
        ),
        SamplingParams(
            max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=3, presence_penalty=1.0
        ),
    ]
    expected = []
    for prompt, sp in zip(prompts, params, strict=True):
        rid = offline.add_request(prompt, sp)
        tokens, logprobs = [], []
        while offline.has_unfinished():
            for out in offline.step():
                if out.request_id == rid:
                    tokens += out.new_token_ids
                    logprobs += out.logprobs or []
        expected.append((tokens, logprobs))

    async def run(client: Client, rid: str, prompt: list[int], sp: SamplingParams) -> list:
        return [
            msg
            async for msg in generate_pd(
                client.prefill, client.decode, rid, prompt, sampling_to_proto(sp), 120
            )
        ]

    async def main() -> list:
        client = Client(mesh, 16, 16)
        try:
            return await asyncio.gather(
                *[
                    run(client, f"lp-{i}", p, sp)
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                ]
            )
        finally:
            await client.close()

    results = asyncio.run(main())
    for sp, messages, (tokens, logprobs) in zip(params, results, expected, strict=True):
        assert [t for m in messages for t in m.token_ids] == tokens
        got = [lp for m in messages for lp in m.logprobs]
        if sp.logprobs is None:
            assert got == []
            continue
        first = messages[0]
        assert first.logprobs[0].token_id == first.token_ids[0] == tokens[0]  # prefill's
        assert [lp.token_id for lp in got] == tokens
        assert [lp.logprob for lp in got] == pytest.approx([e.logprob for e in logprobs], abs=1e-4)
        assert [[t.token_id for t in lp.top] for lp in got] == [
            [t for t, _ in e.top] for e in logprobs
        ]


def test_layout_mismatch_is_refused_at_the_handshake(mesh) -> None:
    async def main() -> PDError:
        client = Client(mesh, prefill_ps=16, decode_ps=1)
        try:
            with pytest.raises(PDError) as err:
                await client.run("mismatch-1", list(range(40)), sampling(4))
            status = await client.broker.Get(kb.HandoffRequest(request_id="mismatch-1"))
            assert status.state == kb.HANDOFF_FAILED
            await client.wait_pages_free(5)
            return err.value
        finally:
            await client.close()

    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "page_size" in err.message and "16" in err.message and "1" in err.message


def test_abort_before_reservation(mesh) -> None:
    async def main() -> None:
        client = Client(mesh, 16, 16)
        try:
            await client.broker.Abort(kb.HandoffRequest(request_id="early-abort"))
            start = time.monotonic()
            with pytest.raises(PDError) as err:
                await client.run("early-abort", list(range(30)), sampling(4))
            assert time.monotonic() - start < 5
            assert err.value.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
            await client.wait_pages_free(2)
        finally:
            await client.close()

    asyncio.run(main())


def test_abort_during_transfer_frees_both_sides(mesh) -> None:
    prompt = (list(range(3, 500)) * 4)[:1800]  # ~19 chunks of 96 tokens

    async def main() -> None:
        client = Client(mesh, 1, 1)  # page size 1: many pages, many chunks of 96
        try:
            task = asyncio.create_task(client.run("mid-transfer", prompt, sampling(4)))
            deadline = time.monotonic() + 30
            while True:
                try:
                    st = await client.broker.Get(kb.HandoffRequest(request_id="mid-transfer"))
                    if st.state == kb.HANDOFF_TRANSFERRING and st.bytes_written > 0:
                        break
                    assert st.state in (kb.HANDOFF_RESERVED, kb.HANDOFF_TRANSFERRING), st
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND
                assert time.monotonic() < deadline, "never saw the transfer in flight"
                await asyncio.sleep(0.005)
            task.cancel()  # the client goes away mid-transfer
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.wait_pages_free(6)
            st = await client.broker.Get(kb.HandoffRequest(request_id="mid-transfer"))
            assert st.state in (kb.HANDOFF_ABORTED, kb.HANDOFF_FAILED)
            assert st.prefill_released
        finally:
            await client.close()

    asyncio.run(main())


def test_abort_during_decode_frees_pages_within_a_second(mesh) -> None:
    async def main() -> None:
        client = Client(mesh, 16, 16)
        try:
            got = 0
            stream = generate_pd(
                client.prefill,
                client.decode,
                "mid-decode",
                list(range(50)),
                sampling(500, ignore_eos=True),
                60,
            )
            async for msg in stream:
                got += len(msg.token_ids)
                if got >= 3:
                    break
            await stream.aclose()  # cancels both calls
            start = time.monotonic()
            await client.wait_pages_free(1.0)
            assert time.monotonic() - start <= 1.0
        finally:
            await client.close()

    asyncio.run(main())


def test_decode_abort_rpc_ends_the_stream(mesh) -> None:
    async def main() -> None:
        client = Client(mesh, 16, 16)
        try:
            reasons: list[str] = []
            count = 0
            aborted = False
            async for msg in generate_pd(
                client.prefill,
                client.decode,
                "rpc-abort",
                list(range(20)),
                sampling(1000, ignore_eos=True),
                60,
            ):
                count += len(msg.token_ids)
                # a message may carry several tokens when the stream lags (a loaded machine)
                if count >= 2 and not aborted:
                    aborted = True
                    await client.decode.Abort(generation_pb2.AbortRequest(request_id="rpc-abort"))
                if msg.finish_reason:
                    reasons.append(msg.finish_reason)
            assert reasons == ["abort"] and count < 1000
            await client.wait_pages_free(1.0)
        finally:
            await client.close()

    asyncio.run(main())


def test_decode_queues_for_pages_then_refuses(mesh) -> None:
    """Decode admits only what its pool can hold: 8 requests whose prompts take 255 pages each
    fill the 2048-page pool, but for a page per request kept free to grow into. A 9th waits
    for pages instead of being refused: when one of the 8 is cancelled it takes the freed
    pages. A 10th that finds none within --reserve-wait (2 s here) gets RESOURCE_EXHAUSTED
    naming the wait. Cancelling frees all."""
    from dsmesh.v1 import decode_pb2

    def request(rid: str, num_prompt: int) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(
            request_id=rid, input_ids=[1] * num_prompt, sampling=sampling(16, ignore_eos=True)
        )

    async def main() -> None:
        client = Client(mesh, 16, 16)

        async def free_pages() -> int:
            return (await client.decode.GetLoad(prefill_pb2.LoadRequest())).free_pages

        async def reserved(rid: str) -> bool:
            try:
                await client.broker.Get(kb.HandoffRequest(request_id=rid))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
                return False
            return True

        try:
            calls = [client.decode.Decode(request(f"fill-{i}", 4080), timeout=60) for i in range(8)]
            deadline = time.monotonic() + 20
            while await free_pages() > 8:  # 8 x 255 pages of 2048
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            waiting = client.decode.Decode(request("fill-wait", 4080), timeout=60)
            waiting_task = asyncio.ensure_future(waiting.initial_metadata())
            await asyncio.sleep(0.5)
            load = await client.decode.GetLoad(prefill_pb2.LoadRequest())
            assert load.free_pages == 8 and load.waiting_handoffs >= 1
            calls[0].cancel()  # its pages go to the waiting request, not back to the pool
            deadline = time.monotonic() + 5
            while not await reserved("fill-wait"):
                assert time.monotonic() < deadline, "the waiting request never got pages"
                await asyncio.sleep(0.05)
            assert await free_pages() == 8  # one for each request to grow into
            over = client.decode.Decode(request("fill-over", 3), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in over:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "pages" in err.value.details() and "waited 2 s" in err.value.details()
            for call in (*calls[1:], waiting):
                call.cancel()
            waiting_task.cancel()
            await client.wait_pages_free(2.0)
        finally:
            await client.close()

    asyncio.run(main())


def test_instance_metrics_move(mesh) -> None:
    import urllib.request

    def scrape(role: str) -> str:
        url = f"http://127.0.0.1:{mesh.metrics_ports[role]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    def value(text: str, line_prefix: str) -> float:
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{line_prefix} missing")

    before_p, before_d = scrape("prefill"), scrape("decode")

    async def main() -> list[int]:
        client = Client(mesh, 16, 16)
        try:
            tokens, _ = await client.run("metrics-1", list(range(40)), sampling(7, ignore_eos=True))
            await client.wait_pages_free(5)
            return tokens
        finally:
            await client.close()

    tokens = asyncio.run(main())
    after_p, after_d = scrape("prefill"), scrape("decode")
    assert (
        value(after_p, "dsmesh_prompt_tokens_total") - value(before_p, "dsmesh_prompt_tokens_total")
        == 40
    )
    assert value(after_p, "dsmesh_kv_transfer_bytes_total") > value(
        before_p, "dsmesh_kv_transfer_bytes_total"
    )
    assert value(after_p, "dsmesh_kv_transfer_seconds_count") > value(
        before_p, "dsmesh_kv_transfer_seconds_count"
    )
    pages, runs = (
        value(after_p, name) - value(before_p, name)
        for name in ("dsmesh_kv_transfer_pages_total", "dsmesh_kv_transfer_page_runs_total")
    )
    # 40 tokens: up to 3 pages of 16 (fewer where decode's prefix cache holds them already)
    assert 1 <= runs <= pages, (pages, runs)
    # decode counts the tokens it generated (the first came from prefill)
    assert value(after_d, "dsmesh_generated_tokens_total") - value(
        before_d, "dsmesh_generated_tokens_total"
    ) == len(tokens)
    assert value(after_d, 'dsmesh_kv_pages_used{role="decode"}') == 0
    assert value(after_p, 'dsmesh_kv_pages_used{role="prefill"}') == 0
    assert value(after_d, 'dsmesh_kv_handoffs_seen_total{state="HANDOFF_DONE"}') >= 1
