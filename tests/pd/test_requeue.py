"""A burst beyond decode's room is queued, not refused: when decode turns a request away for
room after its ``--reserve-wait`` (nothing ran, no page is held), the gateway puts it back
at the head of its queue. Every request the gateway accepted completes with the offline
engine's tokens, however short decode's wait.

kv_broker, prefill, decode and a gateway as separate processes on loopback; KV moves through
the Mooncake transfer engine over TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.runtime.launcher import dsmesh_command
from tests.gateway.kv_mesh import metric, scrape
from tests.mesh import free_port, running_gateway_mesh

pytestmark = pytest.mark.timeout(300)

PAGE_SIZE = 4
POOL_TOKENS = 64  # decode's whole pool: about two of these requests at their longest
NUM_REQUESTS = 10


@dataclass
class Mesh:
    http_port: int
    decode_metrics_port: int
    model_dir: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    metrics_port = free_port()

    def instances(broker: str) -> dict[str, list[str]]:
        common = ("--broker", broker, "--dtype", "float32", "--page-size", str(PAGE_SIZE))
        return {
            "prefill": dsmesh_command("prefill", *common, "--resolve-wait", "120"),
            "decode": dsmesh_command(
                "decode",
                *common,
                *("--max-total-tokens", str(POOL_TOKENS), "--metrics-port", str(metrics_port)),
                *("--reserve-wait", "0.2", "--handoff-timeout", "120"),
            ),
        }

    cache = tmp_path_factory.mktemp("requeue-cache")
    logs = tmp_path_factory.mktemp("requeue-logs")
    with running_gateway_mesh(cache, logs, instances) as (_, port, model):
        yield Mesh(port, metrics_port, model)


def test_requests_decode_turns_away_for_room_wait_at_the_gateway_and_complete(
    mesh: Mesh,
) -> None:
    url = f"http://127.0.0.1:{mesh.http_port}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=240)
    model = openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id
    prompts = [[11 + i, 50 + i, 3, 77 + i] for i in range(NUM_REQUESTS)]

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

    outs = asyncio.run(main())  # any refusal raises here (openai.RateLimitError for a 429)
    room = POOL_TOKENS - len(prompts[0])  # max_tokens omitted: the largest pool's room
    offline = LLMEngine(EngineConfig(model=str(mesh.model_dir), dtype="float32", page_size=4))
    want = offline.generate(prompts, SamplingParams(max_new_tokens=room, ignore_eos=True))
    tok = Tokenizer.from_dir(mesh.model_dir)
    for out, ref in zip(outs, want, strict=True):
        assert out.usage.completion_tokens == room
        assert out.choices[0].text == tok.decode(ref.output_ids, skip_special_tokens=True)
    gateway = scrape(mesh.http_port)
    # decode really turned requests away, and the gateway took them back
    assert metric(gateway, "dsmesh_requests_requeued_total") > 0
    assert metric(gateway, "dsmesh_requests_total", 'outcome="rejected"') == 0
    assert metric(gateway, "dsmesh_requests_total", 'outcome="length"') == NUM_REQUESTS
