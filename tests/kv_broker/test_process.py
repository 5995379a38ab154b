"""``dsmesh kv-broker`` as a real process: reports its port, serves health, stops on SIGTERM."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.v1 import kv_broker_pb2 as pb
from dsmesh.v1 import kv_broker_pb2_grpc


def dsmesh_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsmesh", *args]


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return proc.stdout.readline()


@pytest.fixture
def broker_proc():
    proc = subprocess.Popen(
        dsmesh_argv("kv-broker", "--port", "0", "--heartbeat-interval", "0.2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


def test_process_serves_and_stops_on_sigterm(broker_proc: subprocess.Popen[str]) -> None:
    line = read_line(broker_proc, timeout=15.0)
    assert line.startswith("kv-broker listening on 127.0.0.1:"), line
    address = line.split()[-1]
    with grpc.insecure_channel(address) as chan:
        health = health_pb2_grpc.HealthStub(chan)
        reply = health.Check(health_pb2.HealthCheckRequest(service="dsmesh.v1.KVBroker"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = kv_broker_pb2_grpc.KVBrokerStub(chan)
        stream = stub.Attach(
            pb.AttachRequest(instance=pb.Instance(instance_id="d1", role=pb.ROLE_DECODE)),
            timeout=10,
        )
        assert next(stream).heartbeat
        start = time.monotonic()
        broker_proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the broker ends open Attach streams cleanly
        assert stream.code() == grpc.StatusCode.OK
        assert all(event.heartbeat for event in rest)
    assert broker_proc.wait(timeout=5) == 0, broker_proc.stderr.read()
    assert time.monotonic() - start < 3.0


def test_bad_flag_value_exits_2_with_a_message() -> None:
    proc = subprocess.run(
        dsmesh_argv("kv-broker", "--port", "0", "--handoff-timeout", "-1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "argument --handoff-timeout: must be a positive number of seconds, got -1" in (
        proc.stderr
    )
