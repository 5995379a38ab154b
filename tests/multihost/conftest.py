"""A mesh across hosts: kv_broker, prefill, decode and the gateway each in its own network
namespace (tests/multihost/netns.py), each bound to 0.0.0.0 and advertising its own IP as
the address of its default route's interface (no ``--advertise-host``). Every service uses
its default port: each host has its own ports, and exports its spans to an OTLP receiver in
this process. Skipped where namespaces cannot be made."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from tests.multihost import netns
from tests.telemetry.otlp_receiver import OTLPReceiver

BROKER_PORT, PREFILL_PORT, DECODE_PORT, GRPC_PORT, HTTP_PORT = 50054, 50100, 50200, 50051, 8000
EP_MASTER_PORT = 29600
LIVENESS_GRACE_S = 2.0  # kv_broker's default, stated here because the bounds add it


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1):
    """``predicate()``'s first truthy value within ``timeout_s``, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval_s)


@dataclass
class Mesh:
    net: netns.Network
    hosts: dict[str, netns.Host]  # service -> the host it runs in
    services: dict[str, ServiceProcess]
    model_dir: Path
    log_dir: Path
    receiver: OTLPReceiver  # every service exports its spans here
    env: dict[str, str]  # what every service's environment adds (the exporter's settings)

    def start(self, name: str, host: str, *args: str, timeout: float = 120) -> ServiceProcess:
        """Run ``dsmesh ARGS`` in ``host`` as service ``name`` and wait for it to listen."""
        argv = self.hosts[host].command(dsmesh_command("--log-level", "INFO", *args))
        self.services[name] = proc = start_service(
            name, argv, env=self.env, log_dir=self.log_dir, timeout=timeout
        )
        return proc

    @property
    def http(self) -> str:
        return f"http://{self.hosts['gateway'].address}:{HTTP_PORT}"

    @property
    def grpc_address(self) -> str:
        return f"{self.hosts['gateway'].address}:{GRPC_PORT}"

    @property
    def broker(self) -> str:
        return self.services["kv-broker"].address

    def instances(self) -> list[kb.Instance]:
        with grpc.insecure_channel(self.broker) as ch:
            try:
                return list(
                    kb_grpc.KVBrokerStub(ch)
                    .ListInstances(kb.ListInstancesRequest(), timeout=2)
                    .instances
                )
            except grpc.RpcError:
                return []

    def attached(self, role: kb.Role.ValueType) -> kb.Instance | None:
        return next((i for i in self.instances() if i.role == role), None)

    def handoff(self, request_id: str) -> kb.HandoffStatus | None:
        with grpc.insecure_channel(self.broker) as ch:
            try:
                return kb_grpc.KVBrokerStub(ch).Get(
                    kb.HandoffRequest(request_id=request_id), timeout=2
                )
            except grpc.RpcError:
                return None

    def load(self, service: str):
        """GetLoad of the prefill or decode instance, or None when it does not answer."""
        address = self.services[service].address
        with grpc.insecure_channel(address) as ch:
            stub = (
                prefill_pb2_grpc.PrefillStub(ch)
                if service == "prefill"
                else decode_pb2_grpc.DecodeStub(ch)
            )
            try:
                return stub.GetLoad(prefill_pb2.LoadRequest(), timeout=2)
            except grpc.RpcError:
                return None

    def pages_free(self, service: str) -> bool:
        load = self.load(service)
        return load is not None and load.free_pages == load.total_pages > 0

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for name, proc in self.services.items():
            if proc.log_path is not None and proc.log_path.exists():
                tail = proc.log_path.read_text().splitlines()[-lines:]
                out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)


@pytest.fixture(scope="package")
def network() -> Iterator[netns.Network]:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    with netns.network(5) as net:  # the fifth: node 1 of an EP group
        yield net


@pytest.fixture(scope="package")
def mesh(network: netns.Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The services run on hosts of the same name ("kv-broker", ...; "spare" runs none until
    a test starts one), tracing to an OTLP receiver on the bridge's address."""
    from dsmesh.engine.model.tiny_model import default_model_dir

    model_dir = default_model_dir()  # built once here, before four processes look for it
    log_dir = tmp_path_factory.mktemp("multihost-logs")
    names = ("kv-broker", "prefill", "decode", "gateway", "spare")
    hosts = dict(zip(names, network.hosts, strict=True))
    receiver = OTLPReceiver(network.bridge_address)
    mesh = Mesh(network, hosts, {}, model_dir, log_dir, receiver, receiver.exporter_env())
    model = ("--model", str(model_dir))
    bind = ("--host", "0.0.0.0", "--drain-timeout", "1")
    try:
        broker = mesh.start(
            "kv-broker", "kv-broker", "kv-broker", *bind, "--port", str(BROKER_PORT)
        )
        # 32 tokens per forward: a long prompt is still being written when a test cuts a cable
        prefill_args = ("--port", str(PREFILL_PORT), "--max-batch-tokens", "32")
        common = ("--broker", broker.address, *bind, *model)
        mesh.start("prefill", "prefill", "prefill", *common, *prefill_args)
        mesh.start("decode", "decode", "decode", *common, "--port", str(DECODE_PORT))
        gateway_ports = ("--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT))
        # These tests watch each hop notice a dark host, so a lost request fails instead of
        # moving on (--migration-limit 0); tests/reliability/test_migration.py covers moving.
        no_moves = ("--migration-limit", "0")
        mesh.start("gateway", "gateway", "gateway", *common, *gateway_ports, *no_moves)
        assert wait_until(mesh.healthy, 60), mesh.log_tails()
        yield mesh
    finally:
        for proc in reversed(mesh.services.values()):
            proc.stop(timeout=10)
        receiver.stop()


@pytest.fixture(scope="package")
def offline(mesh: Mesh):
    """The offline engine on the mesh's checkpoint: the tokens every test compares with."""
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(mesh.model_dir), max_total_tokens=1 << 15))
