"""setup_tracing follows the OTEL_* environment: off (and free) by default, on with an
exporter, with the service's own resource."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dsmesh.runtime.telemetry import exporter_names
from tests.telemetry.otlp_receiver import env_without_otel, roots


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ["otlp"]),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, []),
    ],
)
def test_exporter_names_follow_the_environment(env: dict[str, str], expected: list[str]) -> None:
    assert exporter_names(env) == expected


# Runs in a fresh process: the tracer provider is process-global and can be set only once.
PROBE = """
import json, time
from opentelemetry import trace
from dsmesh.runtime import telemetry
from dsmesh.runtime.grpc_server import channel

on = telemetry.setup_tracing("unit")
with telemetry.tracer().start_as_current_span("unit.root") as root:
    recording = root.is_recording()
    now = time.time_ns()
    telemetry.record_span("unit.child", telemetry.current_context(), now - 1000, now, {"n": 7})
ch = channel("127.0.0.1:1")
print(json.dumps({
    "on": on,
    "enabled": telemetry.enabled(),
    "recording": recording,
    "trace_id": format(root.get_span_context().trace_id, "032x"),
    "provider": type(trace.get_tracer_provider()).__name__,
    "server_interceptors": len(telemetry.server_interceptors()),
    "client_interceptors": len(telemetry.client_interceptors()),
    "channel_interceptors": len(getattr(ch, "_unary_unary_interceptors", None) or []),
}))
telemetry.shutdown_tracing()
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_without_otel_environment(receiver) -> None:
    result = probe(env_without_otel())
    assert result == {
        "on": False,
        "enabled": False,
        "recording": False,
        "trace_id": "0" * 32,
        "provider": "ProxyTracerProvider",  # no SDK provider installed
        "server_interceptors": 0,
        "client_interceptors": 0,
        "channel_interceptors": 0,
    }


def test_sdk_disabled_exports_nothing(receiver) -> None:
    before = len(receiver.spans())
    result = probe(env_without_otel(**receiver.exporter_env(), OTEL_SDK_DISABLED="true"))
    assert result["on"] is False and result["recording"] is False
    time.sleep(0.3)
    assert len(receiver.spans()) == before


@pytest.mark.parametrize("service_name_env", [None, "renamed"])
def test_on_exports_to_the_collector(receiver, service_name_env: str | None) -> None:
    env = env_without_otel(
        **receiver.exporter_env(), OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test"
    )
    if service_name_env is not None:
        env["OTEL_SERVICE_NAME"] = service_name_env
    result = probe(env)
    assert result["on"] and result["enabled"] and result["recording"]
    assert result["provider"] == "TracerProvider"
    assert result["server_interceptors"] == 1
    assert result["client_interceptors"] == 4  # unary/stream x unary/stream
    assert result["channel_interceptors"] == 1
    # shutdown_tracing flushed before the process exited: everything is here already.
    spans = {s.name: s for s in receiver.spans(result["trace_id"])}
    assert set(spans) == {"unit.root", "unit.child"}
    root, child = spans["unit.root"], spans["unit.child"]
    assert roots(list(spans.values())) == [root]
    assert child.parent_id == root.span_id
    assert child.attributes == {"n": 7}
    assert child.end_ns - child.start_ns == 1000
    assert root.service == (service_name_env or "unit")
    assert root.resource["deployment.environment"] == "test"
    assert root.resource["service.version"]
