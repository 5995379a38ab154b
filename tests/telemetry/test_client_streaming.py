"""A traced client-streaming call that writes its requests (``call.write``, as an EP group
streams its load to eplb) completes, and its CLIENT span ends in the caller's trace. The
instrumentation's own interceptor waited for the call's status before handing the call back,
while ``write`` waited for the hand-back: the reports never left (found by
tests/multihost/test_ep_across_hosts.py, whose services trace)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.telemetry.otlp_receiver import env_without_otel

# A fresh process: the tracer provider is process-global and can be set only once.
PROBE = """
import asyncio, json
import grpc
from opentelemetry import trace
from dsmesh.clients.eplb import load_report
from dsmesh.runtime import telemetry
from dsmesh.v1 import eplb_pb2_grpc
from tests.eplb.conftest import SHAPE, physical_counts, running_eplb, skewed_counts
from tests.eplb.conftest import trivial_placement

assert telemetry.setup_tracing("unit")
# every call traced (the services leave eplb's streams out): the interceptors with no filter
tracer = trace.get_tracer("probe")
interceptors = [cls(tracer, None) for cls in telemetry._client_interceptor_classes()]

async def main():
    p2l = trivial_placement()
    report = load_report(
        "decode-0", physical_counts(skewed_counts(1), p2l), 10, p2l, SHAPE.num_logical,
        SHAPE.ep_size,
    )
    async with running_eplb() as server:
        async with grpc.aio.insecure_channel(server.address, interceptors=interceptors) as ch:
            with telemetry.tracer().start_as_current_span("unit.root") as root:
                call = eplb_pb2_grpc.EPLBStub(ch).ReportLoad()
                await asyncio.wait_for(call.write(report), 10)
                await call.done_writing()
                await asyncio.wait_for(call, 10)
                code = (await call.code()).name
        return format(root.get_span_context().trace_id, "032x"), code

trace_id, code = asyncio.run(main())
telemetry.shutdown_tracing()
print(json.dumps({"trace_id": trace_id, "code": code}))
"""


def test_a_traced_call_that_writes_its_requests_completes(receiver) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env_without_otel(**receiver.exporter_env()),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["code"] == "OK"
    spans = {s.name: s for s in receiver.spans(result["trace_id"])}
    client = spans["/dsmesh.v1.EPLB/ReportLoad"]
    assert client.parent_id == spans["unit.root"].span_id
    assert client.attributes["rpc.grpc.status_code"] == 0
