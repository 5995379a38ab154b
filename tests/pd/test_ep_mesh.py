"""Prefill and decode as expert-parallel groups (``--ep-size 2``) behind the real mesh:
kv_broker, a gateway, and each rank a mesh member of its own. Outputs equal the offline
engine's for every (prefill rank, decode rank) pair and through the gateway; an idle rank
never stalls its peers; a rank's death takes its group down (for a supervisor to restart)
instead of leaving requests hanging."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from dsmesh.clients.pd import generate_pd
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from dsmesh.v1 import generation_pb2_grpc as gen_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from tests.mesh import group_ranks, start_gateway, two_free_ports, wait_pages_free

pytestmark = pytest.mark.timeout(400)
MAX_NEW = 8


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in lengths]


def generated_tokens(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(r"^dsmesh_generated_tokens_total (\S+)$", text, re.M)
    assert m, text[:500]
    return float(m.group(1))


@pytest.fixture(scope="module")
def ep_mesh(tmp_path_factory: pytest.TempPathFactory):
    import os

    cache = tmp_path_factory.mktemp("cache")
    logs = tmp_path_factory.mktemp("logs")
    env = {"DSMESH_CACHE_DIR": str(cache)}
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from dsmesh.engine.model.tiny_model import default_model_dir

    model = str(default_model_dir())
    procs = []
    try:
        broker = start_service(
            "kv-broker",
            dsmesh_command("kv-broker", "--port", "0", "--liveness-grace", "1"),
            env=env,
            log_dir=logs,
        )
        procs.append(broker)
        engine = ["--model", model, "--max-total-tokens", "8192", "--max-batch-tokens", "64"]
        common = ["--broker", broker.address, "--ep-size", "2", *engine]
        procs.append(
            start_service(
                "prefill-ep",
                dsmesh_command("prefill", *common, "--num-redundant-experts", "2", "--tbo"),
                env=env,
                log_dir=logs,
            )
        )
        metrics = two_free_ports()  # decode rank r serves /metrics on metrics + r
        procs.append(
            start_service(
                "decode-ep",
                dsmesh_command("decode", *common, "--metrics-port", str(metrics)),
                env=env,
                log_dir=logs,
            )
        )
        procs.append(start_gateway(broker.address, model, env, logs))
        yield {"procs": procs, "model": model, "logs": logs, "metrics": metrics}
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def offline(ep_mesh) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ep_mesh["model"], max_total_tokens=1 << 16))


def reference(offline: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [r.output_ids for r in offline.generate(batch, params)]


def _ranks(ep_mesh) -> tuple[list[kb.Instance], list[kb.Instance]]:
    return group_ranks(ep_mesh["procs"][0].address)


def test_each_rank_registers_as_its_own_instance(ep_mesh) -> None:
    prefill, decode = _ranks(ep_mesh)
    for ranks in (prefill, decode):
        ids = [i.instance_id for i in ranks]
        assert [re.sub(r".*-(ep\d)$", r"\1", i) for i in ids] == ["ep0", "ep1"], ids
        assert ids[0][:-4] == ids[1][:-4]  # one instance id, one suffix per rank
        assert len({i.grpc_address for i in ranks}) == 2
        assert len({i.transfer_session for i in ranks}) == 2  # each rank its own KV pool


def test_every_rank_pair_matches_the_offline_engine(ep_mesh, offline) -> None:
    prefill, decode = _ranks(ep_mesh)
    batch = prompts(16, seed=1)
    want = reference(offline, batch)

    async def main() -> list[list[int]]:
        chans = [channel(i.grpc_address) for i in prefill + decode]
        pre = [prefill_pb2_grpc.PrefillStub(c) for c in chans[:2]]
        dec = [decode_pb2_grpc.DecodeStub(c) for c in chans[2:]]

        async def one(i: int, prompt: list[int]) -> list[int]:
            sampling = generation_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
            tokens: list[int] = []
            p, d = pre[i % 2], dec[(i // 2) % 2]  # all four (prefill, decode) rank pairs
            async for msg in generate_pd(p, d, f"pair-{i}", prompt, sampling, 120):
                tokens += list(msg.token_ids)
            return tokens

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        finally:
            for c in chans:
                await c.close()

    assert asyncio.run(main()) == want
    assert wait_pages_free(prefill + decode, within=10)


def test_an_idle_rank_does_not_stall_its_peer(ep_mesh, offline) -> None:
    """Only rank 0 of each group gets work, for many steps; rank 1 idles through them."""
    prefill, decode = _ranks(ep_mesh)
    batch = prompts(4, seed=2)
    want = reference(offline, batch)

    Load = prefill_pb2.PrefillLoad | decode_pb2.DecodeLoad

    async def main() -> tuple[list[list[int]], list[Load]]:
        chans = [channel(prefill[0].grpc_address), channel(decode[0].grpc_address)]
        idle = [channel(prefill[1].grpc_address), channel(decode[1].grpc_address)]
        p, d = prefill_pb2_grpc.PrefillStub(chans[0]), decode_pb2_grpc.DecodeStub(chans[1])

        async def one(i: int, prompt: list[int]) -> list[int]:
            sampling = generation_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
            tokens: list[int] = []
            async for msg in generate_pd(p, d, f"idle-{i}", prompt, sampling, 120):
                tokens += list(msg.token_ids)
            return tokens

        try:
            out = await asyncio.gather(*(one(i, q) for i, q in enumerate(batch)))
            loads = [
                await prefill_pb2_grpc.PrefillStub(idle[0]).GetLoad(prefill_pb2.LoadRequest()),
                await decode_pb2_grpc.DecodeStub(idle[1]).GetLoad(prefill_pb2.LoadRequest()),
            ]
            return out, loads
        finally:
            for c in chans + idle:
                await c.close()

    out, idle_loads = asyncio.run(main())
    assert out == want
    for load in idle_loads:  # the idle ranks took no request and hold no page
        assert load.running_requests == 0
        assert load.free_pages == load.total_pages


def test_gateway_spreads_requests_and_matches_offline(ep_mesh, offline) -> None:
    gateway = ep_mesh["procs"][3]
    batch = prompts(12, seed=3)
    want = reference(offline, batch)
    before = [generated_tokens(ep_mesh["metrics"] + r) for r in (0, 1)]

    async def main() -> list[list[int]]:
        async with channel(gateway.address) as ch:
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

    assert asyncio.run(main()) == want
    served = [generated_tokens(ep_mesh["metrics"] + r) - before[r] for r in (0, 1)]
    assert sum(served) == len(batch) * MAX_NEW
    assert min(served) > 0, served  # both decode ranks took requests
    assert wait_pages_free([*_ranks(ep_mesh)[0], *_ranks(ep_mesh)[1]], within=10)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc."""
    from pathlib import Path

    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_dead_rank_takes_its_group_down(ep_mesh) -> None:
    """Killing one rank process: the group's parent stops the other rank and exits non-zero
    (a supervisor restarts the group whole); nothing is left running."""
    import os
    import signal

    decode = ep_mesh["procs"][2]
    from pathlib import Path

    ranks = [  # the rank processes, not multiprocessing's resource tracker
        pid
        for pid in _children(decode.process.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    code = decode.process.wait(60)
    assert code != 0
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks)


def test_an_impossible_placement_is_refused_before_any_rank_starts() -> None:
    import subprocess

    out = subprocess.run(
        dsmesh_command("decode", "--broker", "127.0.0.1:1", "--ep-size", "3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "cannot be split evenly over 3 ranks" in out.stderr
    assert "Traceback" not in out.stderr
