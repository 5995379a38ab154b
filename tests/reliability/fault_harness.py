"""The fault tests' mesh (``dsmesh up``: kv_broker, one prefill, two decodes, the gateway),
started by :func:`start_mesh`, plus helpers to reach each part of it.

The tests run in file order and each leaves the mesh healthy again (the supervisor restarts
what they kill). Prefill runs 32 tokens per forward so a long prompt stays in flight long
enough to be interrupted.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from dsmesh.engine.model.tiny_model import default_model_dir
from dsmesh.v1 import (
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from tests.mesh import UpProcess, free_port, list_instances, wait_until

PREFILL_CHUNK = 32  # --max-batch-tokens
RESTARTED = r"{name} restarted at (\S+) \(pid (\d+)\), healthy"


def long_prompt(n: int = 3000, salt: int = 0) -> list[int]:
    """``n`` token ids; a different ``salt`` gives a prompt with no shared prefix."""
    return [5 + (i * 7 + salt * 13) % 500 for i in range(n)]


@dataclass
class Mesh:
    up: UpProcess
    log_dir: Path
    http: str  # http://127.0.0.1:PORT
    grpc_address: str  # the gateway's gRPC address
    broker: str

    # ---- where things are -------------------------------------------------------------

    def services(self) -> dict[str, tuple[str, int]]:
        """Service name -> (address, pid), restarts included (the latest wins)."""
        found = self.up.ready_services()
        for m in re.finditer(RESTARTED.format(name=r"(\S+)"), self.up.output):
            found[m.group(1)] = (m.group(2), int(m.group(3)))
        self.up.seen_pids |= {pid for _, pid in found.values()}
        return found

    def restarts(self, name: str) -> int:
        return len(re.findall(RESTARTED.format(name=re.escape(name)), self.up.output))

    def instances(self, role: int) -> dict[str, str]:
        """grpc address -> instance id of the attached instances of ``role``."""
        return {
            i.grpc_address: i.instance_id for i in list_instances(self.broker) if i.role == role
        }

    # ---- stubs --------------------------------------------------------------------------

    def generation(self, ch: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(ch)

    def gateway_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_address)

    def load(self, address: str, role: str):
        """GetLoad of a prefill ("prefill") or decode ("decode") instance, or None."""
        with grpc.insecure_channel(address) as ch:
            stub = (
                prefill_pb2_grpc.PrefillStub(ch)
                if role == "prefill"
                else decode_pb2_grpc.DecodeStub(ch)
            )
            try:
                return stub.GetLoad(prefill_pb2.LoadRequest(), timeout=2)
            except grpc.RpcError:
                return None

    def pages_idle(self, address: str, role: str) -> bool:
        load = self.load(address, role)
        return load is not None and load.free_pages == load.total_pages

    def handoff(self, request_id: str) -> kb.HandoffStatus | None:
        with grpc.insecure_channel(self.broker) as ch:
            try:
                return kb_grpc.KVBrokerStub(ch).Get(
                    kb.HandoffRequest(request_id=request_id), timeout=2
                )
            except grpc.RpcError:
                return None

    def metric(self, name: str) -> float:
        """The sum of every sample of ``name`` on the gateway's /metrics."""
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    # ---- requests -------------------------------------------------------------------------

    def rest(self, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
        """POST /v1/generate: (status, JSON body, headers)."""
        req = urllib.request.Request(f"{self.http}/v1/generate", json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read()), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)

    def generate_ok(self, max_new_tokens: int = 4, timeout: float = 60) -> bool:
        """A short request, retried until it succeeds (True) or ``timeout`` passes."""
        body = {"input_ids": long_prompt(16), "sampling": {"max_new_tokens": max_new_tokens}}
        return bool(wait_until(lambda: self.rest(body, 10)[0] == 200, timeout, 0.25))

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False


def generate_request(
    request_id: str, input_ids: list[int], max_new_tokens: int
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        input_ids=input_ids,
        sampling=generation_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


class Outcome:
    """One streamed gRPC Generate call, run on its own thread."""

    def __init__(self, mesh: Mesh, request_id: str, input_ids: list[int], max_new: int) -> None:
        self.request_id = request_id
        self.tokens = 0
        self.code: grpc.StatusCode | None = None  # None while running; OK when finished
        self.details = ""
        self.ended_at = 0.0
        self.first_token = threading.Event()
        self._channel = mesh.gateway_channel()
        self.call = mesh.generation(self._channel).Generate(
            generate_request(request_id, input_ids, max_new), timeout=120
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.tokens += len(msg.token_ids)
                self.first_token.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        finally:
            self.ended_at = time.monotonic()
            self._channel.close()

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


@contextmanager
def start_mesh(
    tmp_path_factory: pytest.TempPathFactory, decodes: int = 2, extra: tuple[str, ...] = ()
) -> Iterator[Mesh]:
    """``dsmesh up`` with ``decodes`` decodes and ``extra`` flags."""
    cache = tmp_path_factory.mktemp("cache")
    log_dir = tmp_path_factory.mktemp("fault-logs")
    http_port, grpc_port = free_port(), free_port()
    args = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    # The byte-level tiny model: its 512-word vocabulary keeps greedy choices clear of the
    # near-ties that float rounding between a resumed prompt's prefill and the undisturbed
    # decode steps can flip among random weights' 129,280 V3 logits (docs/RELIABILITY.md).
    args += ["--model", str(default_model_dir(cache_dir=cache))]
    args += [
        "--log-dir",
        str(log_dir),
        "--decode",
        str(decodes),
        "--max-batch-tokens",
        str(PREFILL_CHUNK),
    ]
    up = UpProcess([*args, *extra], {"DSMESH_CACHE_DIR": str(cache)})
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=120)
        broker = up.ready_services()["kv-broker"][0]
        m = Mesh(up, log_dir, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", broker)
        assert wait_until(m.healthy, 30)
        yield m
    finally:
        up.close()


def wait_mesh_idle(
    mesh: Mesh,
    timeout: float = 30,
    num_decodes: int = 2,
    num_prefills: int = 1,
    num_unified: int = 0,
) -> None:
    """Every instance attached, every page free, the gateway healthy."""

    def idle() -> bool:
        decodes = mesh.instances(kb.ROLE_DECODE) | mesh.instances(kb.ROLE_UNIFIED)
        prefills = mesh.instances(kb.ROLE_PREFILL)
        return (
            len(decodes) == num_decodes + num_unified
            and len(prefills) == num_prefills
            and all(mesh.pages_idle(a, "decode") for a in decodes)
            and all(mesh.pages_idle(a, "prefill") for a in prefills)
            and mesh.healthy()
        )

    start = time.monotonic()
    if wait_until(idle, timeout):
        return
    loads = [(a, mesh.load(a, "decode")) for a in mesh.instances(kb.ROLE_DECODE)]
    loads += [(a, mesh.load(a, "prefill")) for a in mesh.instances(kb.ROLE_PREFILL)]
    raise AssertionError(
        f"mesh not idle after {time.monotonic() - start:.1f}s (healthy: {mesh.healthy()}); "
        f"loads: {loads}\n{mesh.up.output[-3000:]}"
    )
