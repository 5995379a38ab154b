"""Pages on demand in the PD mesh: a decode pool far too small for the batch. Decode takes a
handed-off request's prompt pages only, grows it as it decodes, and retracts the newest
requests when short; they recompute on decode. Every token reaches the client once, as the
offline engine gives it, and every page comes back. The gateway charges a request its
prompt's pages, so clients that omit ``max_tokens`` (up to the context) run side by side.

kv_broker, prefill, decode and a gateway as separate processes on loopback; KV moves through
the Mooncake transfer engine over TCP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from dsmesh.clients.pd import generate_pd
from dsmesh.engine.llm_engine import EngineConfig, GenerationResult, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command
from dsmesh.v1 import decode_pb2_grpc, generation_pb2, prefill_pb2, prefill_pb2_grpc
from tests.gateway.kv_mesh import metric, scrape
from tests.mesh import free_port, running_gateway_mesh

pytestmark = pytest.mark.timeout(300)

PAGE_SIZE = 4
POOL_TOKENS = 64  # decode's whole pool: 16 pages, a few requests' worth
SLOW_S = "120"  # waits that must outlast the batch (reserve line, resolve, handoff)
RETRACTIONS = ("dsmesh_retractions_total", 'role="decode"')


@dataclass
class Mesh:
    prefill: str  # gRPC addresses
    decode: str
    http_port: int
    decode_metrics_port: int
    model_dir: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    metrics_port = free_port()

    def instances(broker: str) -> dict[str, list[str]]:
        common = ("--broker", broker, "--dtype", "float32", "--page-size", str(PAGE_SIZE))
        return {
            "prefill": dsmesh_command(
                "prefill", *common, "--max-batch-tokens", "64", "--resolve-wait", SLOW_S
            ),
            "decode": dsmesh_command(
                "decode",
                *common,
                *("--max-total-tokens", str(POOL_TOKENS), "--metrics-port", str(metrics_port)),
                *("--reserve-wait", SLOW_S, "--handoff-timeout", SLOW_S),
            ),
        }

    cache = tmp_path_factory.mktemp("retraction-cache")
    logs = tmp_path_factory.mktemp("retraction-logs")
    with running_gateway_mesh(cache, logs, instances) as (procs, port, model):
        yield Mesh(procs["prefill"].address, procs["decode"].address, port, metrics_port, model)


@pytest.fixture(scope="module")
def offline(mesh: Mesh) -> LLMEngine:
    """The same model with a pool that never runs short."""
    config = EngineConfig(model=str(mesh.model_dir), dtype="float32", page_size=PAGE_SIZE)
    return LLMEngine(config)


def retractions(mesh: Mesh) -> float:
    return metric(scrape(mesh.decode_metrics_port), *RETRACTIONS)


async def wait_pages_free(mesh: Mesh, within: float = 10.0) -> None:
    """Until decode and prefill hold no page (failing after ``within`` seconds)."""
    async with channel(mesh.decode) as d_ch, channel(mesh.prefill) as p_ch:
        decode = decode_pb2_grpc.DecodeStub(d_ch)
        prefill = prefill_pb2_grpc.PrefillStub(p_ch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            d = await decode.GetLoad(prefill_pb2.LoadRequest())
            p = await prefill.GetLoad(prefill_pb2.LoadRequest())
            if d.free_pages == d.total_pages and p.free_pages == p.total_pages:
                return
            if loop.time() > deadline:
                pytest.fail(
                    f"pages not freed: decode {d.free_pages}/{d.total_pages}, "
                    f"prefill {p.free_pages}/{p.total_pages}"
                )
            await asyncio.sleep(0.05)


def test_a_decode_pool_too_small_for_the_batch_streams_every_token_once(
    mesh: Mesh, offline: LLMEngine
) -> None:
    g = torch.Generator().manual_seed(19)
    lengths = (3, 9, 14, 6, 20, 11, 5, 17)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=16 + 2 * i, ignore_eos=True) for i in range(8)]
    params[3] = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    params[6] = SamplingParams(max_new_tokens=28)  # may stop at EOS
    want = offline.generate(prompts, params)
    # each fits the pool alone; together they need several times it
    totals = [len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True)]
    assert max(totals) <= POOL_TOKENS and sum(totals) > 3 * POOL_TOKENS
    before = retractions(mesh)

    async def run(i: int, decode, prefill) -> tuple[list[list[int]], str, int]:
        sp = params[i]
        sampling = generation_pb2.SamplingParams(
            max_new_tokens=sp.max_new_tokens, ignore_eos=sp.ignore_eos
        )
        if sp.temperature > 0:
            sampling.temperature = sp.temperature
            sampling.seed = sp.seed
        messages, reason, completion = [], "", 0
        async for msg in generate_pd(prefill, decode, f"small-{i}", prompts[i], sampling, 240):
            messages.append(list(msg.token_ids))
            reason = msg.finish_reason or reason
            completion = msg.completion_tokens
        return messages, reason, completion

    async def main() -> list[tuple[list[list[int]], str, int]]:
        async with channel(mesh.decode) as d_ch, channel(mesh.prefill) as p_ch:
            decode = decode_pb2_grpc.DecodeStub(d_ch)
            prefill = prefill_pb2_grpc.PrefillStub(p_ch)
            results = await asyncio.gather(*[run(i, decode, prefill) for i in range(8)])
        await wait_pages_free(mesh)
        return results

    results = asyncio.run(main())
    for i, ((messages, reason, completion), ref) in enumerate(zip(results, want, strict=True)):
        tokens = [t for m in messages for t in m]
        assert tokens == ref.output_ids, f"request {i}"
        assert reason == ref.finish_reason
        assert completion == len(ref.output_ids)  # the count the client was told, too
        assert all(messages), f"request {i}: a message without a token"
    assert retractions(mesh) > before  # the pool really was short


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_omitted_max_tokens_runs_at_the_concurrency_of_the_prompts(
    mesh: Mesh, offline: LLMEngine
) -> None:
    """No ``max_tokens``: each request may fill decode's whole pool. Charged that, they would
    run one at a time and never be retracted; charged their prompts, they run side by side
    and the pool runs short."""
    url = f"http://127.0.0.1:{mesh.http_port}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=240)
    prompts = [[7 + i, 40 + i, 90 + i, 5] for i in range(3)]
    before = retractions(mesh)

    model = openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id

    async def main() -> list:
        try:
            return await asyncio.gather(
                *[
                    client.completions.create(
                        model=model, prompt=p, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                ]
            )
        finally:
            await client.close()

    outs = asyncio.run(main())
    tok = Tokenizer.from_dir(mesh.model_dir)
    room = POOL_TOKENS - len(prompts[0])  # the largest pool, less the prompt
    want: list[GenerationResult] = offline.generate(
        prompts, SamplingParams(max_new_tokens=room, ignore_eos=True)
    )
    for out, ref in zip(outs, want, strict=True):
        assert out.usage.completion_tokens == room
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].text == tok.decode(ref.output_ids, skip_special_tokens=True)
    assert retractions(mesh) > before
    asyncio.run(wait_pages_free(mesh))

    # A prompt that can never fit, with its first new token, names the prompt; one whose
    # max_tokens can never fit names max_tokens.
    status, body = post(f"{url}/completions", {"model": model, "prompt": [5] * POOL_TOKENS})
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "holds 64" in body["error"]["message"]
    too_long = {"model": model, "prompt": [5] * 30, "max_tokens": 35}
    status, body = post(f"{url}/completions", too_long)
    assert status == 400 and body["error"]["param"] == "max_tokens", body
