"""KV bytes arrive intact: the test plays decode (its own transfer engine and KV pool,
attached to the real kv_broker), the real prefill process writes a prompt's KV into the
reserved pages, and the received pages equal a local recompute of the same prompt."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dsmesh.clients.broker import BrokerLink
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.layout import layout_of
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.transfer import make_transport
from dsmesh.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb

pytestmark = pytest.mark.timeout(180)


def recompute_pages(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """[layers, len(prompt), kv_dim] KV of the prompt, computed here in one pass."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=1), "ref", prefill_only=True)
    while engine.requests["ref"].status.value != "finished":
        engine.step()
    req = engine.requests["ref"]
    kv = engine.kv_pool.buffer[:, req.pages].flatten(1, 2)[:, : len(prompt)].clone()
    engine.release("ref")
    return kv


def test_pages_received_by_decode_equal_a_prefill_side_recompute(mesh) -> None:
    from dsmesh.engine.model.tiny_model import default_model_dir

    model_dir = str(default_model_dir())
    page_size = 16
    decode_engine = LLMEngine(
        EngineConfig(model=model_dir, page_size=page_size, max_total_tokens=4096)
    )
    local = LLMEngine(EngineConfig(model=model_dir, page_size=page_size, max_total_tokens=4096))
    prompt = (list(range(5, 400)) * 2)[:333]  # 21 pages, the last one partial
    transport = make_transport("mooncake")
    pool = transport.register_pool(decode_engine.kv_pool)
    reserved = decode_engine.reserve(prompt, SamplingParams(max_new_tokens=40), "intact")
    # The prompt's 21 pages (generated tokens take theirs as they come). They are handed to
    # the broker in reverse order, so a page-mapping error cannot cancel out.
    assert len(reserved.pages) == 21

    async def main() -> tuple[kb.HandoffStatus, prefill_pb2.PrefillResponse]:
        instance = kb.Instance(
            instance_id="test-decode-intact",
            role=kb.ROLE_DECODE,
            transfer_session=pool.session,
        )
        link = BrokerLink(mesh.broker.address, instance)
        link.start()
        ch = channel(mesh.prefill[page_size].address)
        try:
            assert await link.wait_attached(10)
            await link.stub.Reserve(
                kb.ReserveRequest(
                    request_id="intact",
                    decode_instance_id=instance.instance_id,
                    layout=layout_of(decode_engine, transport.signature),
                    pool=kb.RemotePool(
                        transfer_session=pool.session,
                        base_ptr=pool.base_ptr,
                        num_pages=pool.num_pages,
                        page_bytes=pool.page_bytes,
                    ),
                    page_ids=list(reversed(reserved.pages)),
                    num_tokens=len(prompt),
                ),
                timeout=5,
            )
            response = await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="intact",
                    input_ids=prompt,
                    sampling=generation_pb2.SamplingParams(max_new_tokens=8),
                ),
                timeout=60,
            )
            status = await link.stub.Await(kb.AwaitRequest(request_id="intact", wait_ms=5000))
            return status, response
        finally:
            await ch.close()
            await link.close()

    try:
        status, response = asyncio.run(main())
    finally:
        transport.close()
    assert status.state == kb.HANDOFF_DONE
    assert status.prefill_released
    pages = list(reversed(reserved.pages))
    n_pages = -(-len(prompt) // page_size)
    buf = decode_engine.kv_pool.buffer
    received = buf[:, pages[:n_pages]].flatten(1, 2)[:, : len(prompt)]
    expected = recompute_pages(local, prompt)
    assert received.abs().sum() > 0
    torch.testing.assert_close(received, expected, rtol=1e-5, atol=1e-5)
    # no page outside the reservation was touched
    others = sorted(set(range(decode_engine.kv_pool.num_pages)) - set(pages))
    assert buf[:, others].abs().sum() == 0
    assert response.kv_bytes == n_pages * decode_engine.kv_pool.page_bytes * buf.shape[0]
    assert (
        response.first_token_id
        == local.generate([prompt], SamplingParams(max_new_tokens=1))[0].output_ids[0]
    )
