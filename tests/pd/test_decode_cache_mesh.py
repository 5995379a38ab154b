"""The decode cache skips pages it holds: a PD mesh of one prefill and two decode instances
behind a gateway, as real processes on loopback (Mooncake over TCP, the tiny default model in
float32). Turn 1 of a conversation runs on decode-1; turn 2 (turn 1's prompt and output, and
new text) goes through the gateway back to decode-1, whose prefix cache kept turn 1, and
prefill writes only the pages after the ones decode-1 holds. Tokens equal the offline
engine's; an aborted turn leaks no page and leaves its KV cached."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.clients.pd import generate_pd
from dsmesh.decode_svc.handoff import Reservation
from dsmesh.engine.kv.prefix_hashes import page_hashes
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command
from dsmesh.v1 import decode_pb2_grpc, generation_pb2, prefill_pb2, prefill_pb2_grpc
from tests.gateway.kv_mesh import metric, scrape
from tests.mesh import free_port, running_gateway_mesh

pytestmark = pytest.mark.timeout(300)

PAGE = 4
NEW_TOKENS = 11
FIRST_PROMPT = [3 + (i * 7) % 300 for i in range(37)]  # 10 pages, the last one partial
FOLLOW_UP = [5, 6, 7, 8, 9]


@dataclass
class Mesh:
    procs: dict[str, ServiceProcess]
    http_port: int
    model: Path
    metrics_ports: dict[str, int]  # prefill-0, decode-0, decode-1

    def scrape(self, name: str) -> str:
        return scrape(self.metrics_ports[name])

    def value(self, name: str, metric_name: str, labels: str = "") -> float:
        return metric(self.scrape(name), metric_name, labels)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    ports = {name: free_port() for name in ("prefill-0", "decode-0", "decode-1")}

    def instances(broker: str) -> dict[str, list[str]]:
        def command(name: str) -> list[str]:
            role = name.split("-")[0]
            return dsmesh_command(
                role,
                *("--broker", broker, "--instance-id", name, "--dtype", "float32"),
                *("--page-size", str(PAGE), "--max-total-tokens", "4096"),
                *("--metrics-port", str(ports[name])),
            )

        return {name: command(name) for name in ports}

    cache, logs = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("logs")
    with running_gateway_mesh(cache, logs, instances) as (procs, http_port, model):
        yield Mesh(procs, http_port, model, ports)


@pytest.fixture(scope="module")
def offline(mesh: Mesh) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(mesh.model), page_size=PAGE, max_total_tokens=4096))


def greedy(engine: LLMEngine, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].output_ids


def sampling(new_tokens: int = NEW_TOKENS) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)


async def run_pair(mesh: Mesh, decode: str, rid: str, prompt: list[int], stop_after: int = 0):
    """A request on prefill-0 and ``decode`` directly, past the gateway; with ``stop_after``
    the client goes away after that many messages. Returns (tokens, prefill's answer)."""
    answers: list[prefill_pb2.PrefillResponse] = []
    tokens: list[int] = []
    p_ch = channel(mesh.procs["prefill-0"].address)
    d_ch = channel(mesh.procs[decode].address)
    try:
        new_tokens = 200 if stop_after else NEW_TOKENS
        stream = generate_pd(
            prefill_pb2_grpc.PrefillStub(p_ch),
            decode_pb2_grpc.DecodeStub(d_ch),
            rid,
            prompt,
            sampling(new_tokens),
            120,
            on_prefilled=answers.append,
        )
        async for n, msg in aenumerate(stream):
            tokens += list(msg.token_ids)
            if stop_after and n + 1 == stop_after:
                break
        await stream.aclose()
        return tokens, answers[0] if answers else None
    finally:
        await p_ch.close()
        await d_ch.close()


async def aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def via_gateway(mesh: Mesh, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{mesh.http_port}/v1/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [int(t) for t in json.loads(resp.read())["token_ids"]]


def pages_free(mesh: Mesh, within: float = 10.0) -> None:
    """Every instance's pages come back (idle cached pages count as free)."""
    deadline = time.monotonic() + within
    while True:
        used = {
            name: mesh.value(name, "dsmesh_kv_pages_used", f'role="{name.split("-")[0]}"')
            for name in mesh.metrics_ports
        }
        if not any(used.values()):
            return
        assert time.monotonic() < deadline, f"pages still held: {used}"
        time.sleep(0.05)


def cached_after(prompt_and_output: int) -> int:
    """Full pages decode keeps of a finished request: its prompt and output less the last
    token, whose KV was never computed."""
    return (prompt_and_output - 1) // PAGE


def test_a_reservation_names_the_pages_it_holds() -> None:
    prompt = list(range(50))
    assert Reservation([9, 8, 7], 0).cached_prefix(prompt, PAGE) == 0
    assert (
        Reservation(list(range(13)), 11).cached_prefix(prompt, PAGE)
        == (page_hashes(prompt, PAGE)[10])
    )


def test_a_follow_up_turn_skips_the_pages_its_decode_holds(mesh: Mesh, offline: LLMEngine) -> None:
    transfer = "dsmesh_kv_transfer_bytes_total"
    done = ("dsmesh_kv_handoffs_seen_total", 'state="HANDOFF_DONE"')
    # turn 1, on decode-1 (by load alone the gateway picks decode-0: a tie, the smaller id)
    turn1, answer = asyncio.run(run_pair(mesh, "decode-1", "turn-1", FIRST_PROMPT))
    assert turn1 == greedy(offline, FIRST_PROMPT)
    assert answer is not None
    page_bytes = answer.kv_bytes // 10  # all layers of one page: the prompt's 10 pages
    assert answer.kv_bytes == 10 * page_bytes and mesh.value("decode-1", *done) == 1
    held = cached_after(len(FIRST_PROMPT) + NEW_TOKENS)  # 11 pages of (37 + 11 - 1) tokens
    assert mesh.value("decode-1", "dsmesh_prefix_cache_pages", 'role="decode"') == held
    pages_free(mesh)
    time.sleep(2.5)  # the gateway polls each instance's prefix digest 4 times a second

    # turn 2 through the gateway: 53 tokens, 14 pages, of which decode-1 holds 11
    second = FIRST_PROMPT + turn1 + FOLLOW_UP
    written_before = mesh.value("prefill-0", transfer)
    turn2 = via_gateway(mesh, second)
    assert turn2 == greedy(offline, second)
    assert (mesh.value("decode-0", *done), mesh.value("decode-1", *done)) == (0, 2)
    skipped = mesh.value("decode-1", "dsmesh_kv_handoff_skipped_pages_total")
    assert skipped == held == 11
    assert mesh.value("decode-1", "dsmesh_kv_handoff_skipped_bytes_total") == 11 * page_bytes
    # prefill wrote only the 3 pages after them
    assert mesh.value("prefill-0", transfer) - written_before == 3 * page_bytes
    hits = mesh.value("decode-1", "dsmesh_prefix_cache_hit_tokens_total", 'role="decode"')
    assert hits == held * PAGE
    pages_free(mesh)

    # turn 3, on decode-1 directly: its client goes away after the first tokens
    third = second + turn2 + FOLLOW_UP
    tokens, _ = asyncio.run(run_pair(mesh, "decode-1", "turn-3", third, stop_after=2))
    assert len(tokens) >= 2
    pages_free(mesh)  # nothing leaks: decode and prefill hold no page of the aborted turn
    # its handoff was DONE, and skipped the pages turn 2 left
    skipped_now = mesh.value("decode-1", "dsmesh_kv_handoff_skipped_pages_total")
    assert skipped_now - skipped == cached_after(len(second) + NEW_TOKENS) == 15
    # what it computed before it went stays cached: a retry holds all but the last page
    written_before = mesh.value("prefill-0", transfer)
    retry, _ = asyncio.run(run_pair(mesh, "decode-1", "turn-3-retry", third))
    assert retry == greedy(offline, third)
    retry_skipped = mesh.value("decode-1", "dsmesh_kv_handoff_skipped_pages_total") - skipped_now
    last = -(-len(third) // PAGE)  # 18 pages of 69 tokens
    assert retry_skipped == cached_after(len(third)) == last - 1
    assert mesh.value("prefill-0", transfer) - written_before == page_bytes
    pages_free(mesh)
