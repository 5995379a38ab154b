"""The mesh on a GPU, as a user starts it: ``dsmesh up --device cuda`` (prefill and decode
sharing the GPU, KV moved by CUDA IPC) and a unified instance give the in-process engine's
greedy tokens, in float32 on the tiny default model. Skipped without a GPU; run on an
H200."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.v1 import generation_pb2, generation_pb2_grpc
from tests.mesh import UpProcess, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

MAX_NEW = 24


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 9, 16, 17, 200, 700)]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"DSMESH_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def expected(cache_env, monkeypatch_module) -> list[list[int]]:
    monkeypatch_module.setenv("DSMESH_CACHE_DIR", cache_env["DSMESH_CACHE_DIR"])
    engine = LLMEngine(
        EngineConfig(device="cuda", dtype="float32", max_total_tokens=16384, page_size=16)
    )
    results = engine.generate(prompts(), SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    del engine
    torch.cuda.empty_cache()
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


async def _generate_all(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(ids: list[int]) -> list[int]:
            request = generation_pb2.GenerateRequest(
                input_ids=ids,
                sampling=generation_pb2.SamplingParams(
                    max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.0
                ),
                stream=True,
            )
            tokens: list[int] = []
            async for msg in stub.Generate(request, timeout=120):
                tokens += list(msg.token_ids)
            return tokens

        return list(await asyncio.gather(*(one(p) for p in prompts())))


@pytest.mark.parametrize(
    "topology", [[], ["--prefill", "0", "--decode", "0", "--unified", "1"]], ids=["pd", "unified"]
)
def test_mesh_on_gpu_matches_the_engine(cache_env, expected, topology: list[str]) -> None:
    grpc_port, http_port = free_port(), free_port()
    up = UpProcess(
        [
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "16384",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            *topology,
        ],
        cache_env,
        log_level="info",  # the instances log the transport they chose
    )
    try:
        up.wait_for(r"dsmesh mesh ready", timeout=300)
        got = asyncio.run(_generate_all(f"127.0.0.1:{grpc_port}"))
        assert got == expected
        if not topology:  # prefill and decode chose CUDA IPC on their own
            log_dir = Path(up.wait_for(r"dsmesh up: logs\s+(\S+)", timeout=5).group(1))
            for role in ("prefill-0", "decode-0"):
                assert "moves by mooncake/nvlink_intra" in (log_dir / f"{role}.log").read_text()
    finally:
        up.process.terminate()
        up.process.wait(60)
