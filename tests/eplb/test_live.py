"""Live EPLB under load: prefill and decode EP groups (EP 2, 2 redundant experts) stream
their expert load to a real eplb_svc, which pushes placements that the groups swap in
between steps. The checkpoint's router is skewed (a few experts get a large V3 correction
bias, the test's way of biasing routing), so the round-robin placement is unbalanced.

Checked: at least two rebalances reach both groups, every request succeeds, greedy outputs
equal the offline engine's before, during and after the swaps, and the measured balancedness
of the decode group rises."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.v1 import eplb_pb2, eplb_pb2_grpc, generation_pb2
from dsmesh.v1 import generation_pb2_grpc as gen_grpc
from tests.mesh import free_port, instance_load, start_gateway

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 6
# expert -> router correction bias boost. Experts 2-5 (two groups of 4) win every token's top 4;
# the round-robin placement puts all four on rank 0 with no replica elsewhere (replicas go to
# experts 0 and 1), so one rank does all the routed work until EPLB spreads them.
HOT = {2: 0.4, 3: 0.4, 4: 0.4, 5: 0.4}


def skewed_checkpoint(root: Path) -> Path:
    from dsmesh.engine.model.tiny_model import default_model_dir

    out = root / "skewed"
    shutil.copytree(default_model_dir(), out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                for expert, boost in HOT.items():
                    t[expert] += boost
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def metric(port: int, name: str, labels: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 500, (int(k),), generator=g).tolist()
        for k in torch.randint(4, 60, (n,), generator=g)
    ]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("eplb_live")
    env = {"DSMESH_CACHE_DIR": str(root / "cache")}
    os.environ["DSMESH_CACHE_DIR"] = env["DSMESH_CACHE_DIR"]
    model = str(skewed_checkpoint(root))
    logs = root / "logs"
    logs.mkdir()
    eplb_metrics = free_port()
    procs = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        procs.append(broker)
        eplb = start_service(
            "eplb",
            dsmesh_command(
                "eplb",
                "serve",
                "--port",
                "0",
                "--interval",
                "2",
                "--threshold",
                "0.02",
                "--window-steps",
                "12",
                "--metrics-port",
                str(eplb_metrics),
            ),
            env=env,
            log_dir=logs,
        )
        procs.append(eplb)
        common = [
            "--broker",
            broker.address,
            "--model",
            model,
            "--ep-size",
            "2",
            "--num-redundant-experts",
            "2",
            "--eplb",
            eplb.address,
            "--eplb-report-interval",
            "0.5",
            "--max-total-tokens",
            "8192",
        ]
        for role in ("prefill", "decode"):
            procs.append(
                start_service(
                    role,
                    dsmesh_command(role, *common, "--instance-id", f"{role}-live"),
                    env=env,
                    log_dir=logs,
                )
            )
        gateway = start_gateway(broker.address, model, env, logs)
        procs.append(gateway)
        yield {
            "model": model,
            "gateway": gateway,
            "eplb": eplb,
            "eplb_metrics": eplb_metrics,
            "procs": procs,
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


async def _generate(address: str, batch: list[list[int]]) -> list[list[int]]:
    async with channel(address) as ch:
        stub = gen_grpc.GenerationStub(ch)

        async def one(prompt: list[int]) -> list[int]:
            req = generation_pb2.GenerateRequest(
                input_ids=prompt,
                sampling=generation_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
            )
            tokens: list[int] = []
            async for msg in stub.Generate(req, timeout=120):
                tokens += list(msg.token_ids)
            return tokens

        return await asyncio.gather(*(one(p) for p in batch))


async def _force_rebalance(address: str) -> eplb_pb2.RebalanceResponse:
    async with channel(address) as ch:
        return await eplb_pb2_grpc.EPLBStub(ch).Rebalance(eplb_pb2.RebalanceRequest(force=True))


def test_rebalances_under_load_keep_outputs_and_raise_balancedness(live) -> None:
    offline = LLMEngine(EngineConfig(model=live["model"], max_total_tokens=1 << 15))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    port = live["eplb_metrics"]

    def applied(role: str) -> float:
        return metric(port, "dsmesh_eplb_applied_version", f'instance="{role}-live"') or 0.0

    def measured() -> float | None:
        return metric(port, "dsmesh_expert_balancedness", 'instance="decode-live",when="measured"')

    # The decode's balancedness as eplb measured it before its first swap: eplb measures at
    # each tick (every 2 s) and a swap follows the tick that decides it, so a thread watches
    # while the rounds run (a round can outlast a tick), keeping a value read while no swap
    # had been applied on either side of the read.
    first: list[float] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.05) and applied("decode") == 0:
            value = measured()
            if value is not None and applied("decode") == 0:
                first[:] = [value]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    rounds = 0
    forced = False
    deadline = time.monotonic() + 240
    while True:
        batch = prompts(8, seed=rounds)
        want = [r.output_ids for r in offline.generate(batch, params)]
        got = asyncio.run(_generate(live["gateway"].address, batch))  # every request succeeds
        assert got == want, f"round {rounds}: outputs differ from the offline engine"
        rounds += 1
        if not forced and min(applied("prefill"), applied("decode")) >= 1:
            response = asyncio.run(_force_rebalance(live["eplb"].address))
            assert {p.instance_id for p in response.placements} == {"prefill-live", "decode-live"}
            forced = True
        if forced and min(applied("prefill"), applied("decode")) >= 2:
            break
        assert time.monotonic() < deadline, (
            f"after {rounds} rounds: applied versions prefill {applied('prefill')}, "
            f"decode {applied('decode')}"
        )
    # after the swaps: more rounds, still equal, until the window holds only new-placement load
    for extra in range(3):
        batch = prompts(8, seed=1000 + extra)
        want = [r.output_ids for r in offline.generate(batch, params)]
        assert asyncio.run(_generate(live["gateway"].address, batch)) == want
    time.sleep(1.5)  # the last reports reach eplb
    for role in ("prefill", "decode"):
        total = metric(port, "dsmesh_eplb_rebalances_total", f'instance="{role}-live"')
        assert total is not None and total >= 2
    watching.set()
    watcher.join(5)
    assert first, "no load was measured before the first swap"
    first_measured = first[0]
    final = measured()
    print(f"decode balancedness measured {first_measured} -> {final} after {rounds} rounds")
    assert final is not None and final > first_measured + 0.2, (first_measured, final)
    assert asyncio.run(_pages_free(live["procs"][0].address, within=10))  # no leaked page


async def _pages_free(broker: str, within: float) -> bool:
    """Every rank of both groups has all its KV pages back after the swaps."""
    from dsmesh.v1 import kv_broker_pb2 as kb
    from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

    deadline = time.monotonic() + within
    while True:
        async with channel(broker) as ch:
            listing = await kb_grpc.KVBrokerStub(ch).ListInstances(kb.ListInstancesRequest())
        free = []
        for inst in listing.instances:
            load = await instance_load(inst)
            free.append(load.free_pages == load.total_pages)
        if len(free) == 4 and all(free):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
