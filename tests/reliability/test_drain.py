"""SIGTERM drains a service: it stops admitting at once, and what it accepted finishes.

A mesh of processes (kv_broker, prefill, decode, gateway) serves 8 long gRPC streams; the
decode gets SIGTERM once every stream has tokens. Its health must go NOT_SERVING and new
calls get UNAVAILABLE while every stream runs to its last token; then the decode exits 0.
The same for the gateway: a draining gateway answers new REST requests 503 and finishes its
streams.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.engine.model.tiny_model import default_model_dir
from dsmesh.runtime.drain import DRAINING_MESSAGE
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
)
from tests.mesh import free_port

STREAMS = 8
NEW_TOKENS = 600
WAIT_S = 60.0


@dataclass
class Mesh:
    broker: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess
    gateway_grpc: str
    gateway_http: str
    gateway: ServiceProcess


@pytest.fixture
def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(cache))
    model = str(default_model_dir())  # built once, before the processes race for it
    env = {"DSMESH_CACHE_DIR": str(cache)}
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        instance = ["--broker", broker.address, "--max-total-tokens", "32768"]
        prefill = start_service(
            "prefill", dsmesh_command("prefill", *instance), env=env, log_dir=logs
        )
        started.append(prefill)
        decode = start_service(
            "decode",
            dsmesh_command("--log-level", "INFO", "decode", *instance, "--drain-timeout", "60"),
            env=env,
            log_dir=logs,
        )
        started.append(decode)
        http_port = free_port()
        args = dsmesh_command(
            "gateway",
            *("--broker", broker.address, "--model", model, "--drain-timeout", "60"),
            *("--grpc-port", "0", "--http-port", str(http_port)),
        )
        gateway = start_service("gateway", args, env=env, log_dir=logs)
        started.append(gateway)
        wait_for(lambda: http_status(f"http://127.0.0.1:{http_port}/health") == 200, "the mesh")
        yield Mesh(
            broker,
            prefill,
            decode,
            gateway.address,
            f"http://127.0.0.1:{http_port}",
            gateway,
        )
    finally:
        for proc in reversed(started):
            proc.stop()


class Stream(threading.Thread):
    """One Generate stream through the gateway, recording its tokens and how it ended."""

    def __init__(self, address: str, index: int) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.prompt = [5 + (index * 11 + i * 3) % 200 for i in range(40)]
        self.tokens: list[int] = []
        self.finish = ""
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        request = generation_pb2.GenerateRequest(
            input_ids=self.prompt,
            sampling=generation_pb2.SamplingParams(
                temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True
            ),
        )
        with grpc.insecure_channel(self.address) as ch:
            try:
                for msg in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=WAIT_S):
                    self.tokens += msg.token_ids
                    if self.tokens:
                        self.started.set()
                    if msg.finish_reason:
                        self.finish = msg.finish_reason
            except grpc.RpcError as exc:
                self.error = exc
            finally:
                self.started.set()


def start_streams(address: str) -> list[Stream]:
    streams = [Stream(address, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(WAIT_S)
        assert s.error is None, s.error
    return streams


def finish_streams(streams: list[Stream]) -> None:
    for s in streams:
        s.join(WAIT_S)
        assert not s.is_alive()
        assert s.error is None, f"stream cut by the drain: {s.error}"
        assert (len(s.tokens), s.finish) == (NEW_TOKENS, "length")


def http_status(url: str, body: dict | None = None) -> tuple[int, str] | int:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=5) as resp:
            return resp.status if body is None else (resp.status, resp.read().decode())
    except urllib.error.HTTPError as exc:
        return exc.code if body is None else (exc.code, exc.read().decode())


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigterm_to_decode_finishes_its_streams_and_admits_nothing_new(mesh: Mesh) -> None:
    streams = start_streams(mesh.gateway_grpc)
    mesh.decode.process.send_signal(signal.SIGTERM)
    wait_for(
        lambda: health(mesh.decode.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
        "decode health NOT_SERVING",
    )
    assert any(s.is_alive() for s in streams)  # the drain began with streams still running
    with grpc.insecure_channel(mesh.decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for call in (
            lambda: stub.GetLoad(prefill_pb2.LoadRequest(), timeout=5),
            lambda: list(stub.Decode(decode_pb2.DecodeRequest(request_id="late"), timeout=5)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == DRAINING_MESSAGE
    finish_streams(streams)
    assert mesh.decode.process.wait(WAIT_S) == 0
    assert "drained in" in (mesh.decode.log_path.read_text())


def test_sigterm_to_gateway_finishes_its_streams_and_refuses_new_requests(mesh: Mesh) -> None:
    streams = start_streams(mesh.gateway_grpc)
    mesh.gateway.process.send_signal(signal.SIGTERM)

    def refused() -> bool:
        status, text = http_status(
            f"{mesh.gateway_http}/v1/generate",
            {"input_ids": [5, 6, 7], "sampling": {"max_new_tokens": 2}},
        )
        return status == 503 and DRAINING_MESSAGE in text

    wait_for(refused, "the gateway to refuse new REST requests")
    assert any(s.is_alive() for s in streams)  # the drain began with streams still running
    assert http_status(f"{mesh.gateway_http}/health") == 503
    with grpc.insecure_channel(mesh.gateway_grpc) as ch:
        late = generation_pb2.GenerateRequest(input_ids=[5, 6, 7])
        with pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(late, timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finish_streams(streams)
    assert mesh.gateway.process.wait(WAIT_S) == 0
