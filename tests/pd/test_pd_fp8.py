"""``--kv-cache-dtype fp8_e4m3`` across the PD handoff, with kv_broker, prefill and decode as
real processes on loopback: the pages (codes and their scales) cross the transfer engine, so
greedy tokens equal the offline FP8 engine's; a prefill and a decode whose caches differ
(FP8 against float32) are refused at the handshake, naming the dtype on both sides."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dsmesh.clients.pd import PDError, generate_pd
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.v1 import decode_pb2_grpc, generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

pytestmark = pytest.mark.timeout(300)
PAGE_SIZE = 16
PREFILL_CHUNK = 96


@pytest.fixture(scope="module")
def fp8_mesh(tmp_path_factory: pytest.TempPathFactory):
    """kv_broker; an FP8 prefill; an FP8 decode and a model-dtype decode (float32 on CPU)."""
    cache = tmp_path_factory.mktemp("cache")
    logs = tmp_path_factory.mktemp("logs")
    env = {"DSMESH_CACHE_DIR": str(cache)}
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from dsmesh.engine.model.tiny_model import default_model_dir

    default_model_dir()  # built once, before the processes race for it
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
    )
    common = ["--broker", broker.address, "--page-size", str(PAGE_SIZE)]
    common += ["--max-total-tokens", "16384"]
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    chunk = ["--max-batch-tokens", str(PREFILL_CHUNK)]
    specs = {
        "prefill-fp8": dsmesh_command("prefill", *common, *fp8, *chunk),
        "decode-fp8": dsmesh_command("decode", *common, *fp8, "--handoff-timeout", "20"),
        "decode-auto": dsmesh_command("decode", *common, "--handoff-timeout", "20"),
    }
    started = [broker]
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(start_service, name, args, env, logs)
                for name, args in specs.items()
            }
            procs = {name: f.result() for name, f in futures.items()}
        started += list(procs.values())
        yield {"broker": broker, **procs}
    finally:
        for proc in reversed(started):
            proc.stop()


async def _generate(mesh, decode: str, rid: str, prompt: list[int], max_new: int):
    async with (
        channel(mesh["prefill-fp8"].address) as p_ch,
        channel(mesh[decode].address) as d_ch,
    ):
        prefill = prefill_pb2_grpc.PrefillStub(p_ch)
        decoder = decode_pb2_grpc.DecodeStub(d_ch)
        sampling = generation_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        tokens: list[int] = []
        async for msg in generate_pd(prefill, decoder, rid, prompt, sampling, 120):
            tokens += list(msg.token_ids)
        return tokens


async def _pages_free(mesh) -> bool:
    for name, stub_cls in (("prefill-fp8", prefill_pb2_grpc.PrefillStub),
                           ("decode-fp8", decode_pb2_grpc.DecodeStub)):  # fmt: skip
        async with channel(mesh[name].address) as ch:
            load = await stub_cls(ch).GetLoad(prefill_pb2.LoadRequest())
            if load.free_pages != load.total_pages:
                return False
    return True


def test_fp8_prefill_and_decode_equal_the_offline_fp8_engine(fp8_mesh) -> None:
    from dsmesh.engine.model.tiny_model import default_model_dir

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 17, 150, 300)]
    offline = LLMEngine(
        EngineConfig(
            model=str(default_model_dir()),
            page_size=PAGE_SIZE,
            max_total_tokens=16384,
            max_batch_tokens=PREFILL_CHUNK,
            kv_cache_dtype="fp8_e4m3",
        )
    )
    assert offline.kv_pool.fp8
    want = [
        r.output_ids
        for r in offline.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    ]

    async def main() -> list[list[int]]:
        got = await asyncio.gather(
            *[_generate(fp8_mesh, "decode-fp8", f"fp8-{i}", p, 12) for i, p in enumerate(prompts)]
        )
        for _ in range(100):  # pages come back once the streams are over
            if await _pages_free(fp8_mesh):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("pages not freed within 5 s")
        return got

    assert asyncio.run(main()) == want


def test_fp8_prefill_and_a_model_dtype_decode_are_refused_at_the_handshake(fp8_mesh) -> None:
    async def main() -> tuple[PDError, kb.HandoffStatus]:
        with pytest.raises(PDError) as err:
            await _generate(fp8_mesh, "decode-auto", "mixed-1", list(range(40)), 4)
        async with channel(fp8_mesh["broker"].address) as ch:
            status = await kb_grpc.KVBrokerStub(ch).Get(kb.HandoffRequest(request_id="mixed-1"))
        return err.value, status

    err, status = asyncio.run(main())
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype prefill=fp8_e4m3 decode=float32" in err.message
    assert (status.state, status.cause) == (kb.HANDOFF_FAILED, kb.CAUSE_LAYOUT_MISMATCH)
