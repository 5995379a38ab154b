"""An in-process OTLP/gRPC trace receiver for the tests: a real
``opentelemetry.proto.collector.trace.v1.TraceService`` on a free loopback port that keeps
every span it is sent, flattened into :class:`SpanRecord`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR


@dataclass(frozen=True)
class SpanRecord:
    service: str  # resource service.name
    resource: dict[str, Any]
    scope: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int
    attributes: dict[str, Any]
    status: int  # trace_pb2.Status.StatusCode
    start_ns: int
    end_ns: int


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Start on construction, on a free port of ``host`` (another address than loopback for
    exporters on other hosts: tests/multihost); ``endpoint`` goes into
    ``OTEL_EXPORTER_OTLP_ENDPOINT``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def exporter_env(self) -> dict[str, str]:
        """What a process needs to export its spans here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def Export(  # noqa: N802 - gRPC method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        records = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    records.append(
                        SpanRecord(
                            service=resource.get("service.name", ""),
                            resource=resource,
                            scope=ss.scope.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            status=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self._spans += records
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, done: Callable[[list[SpanRecord]], bool], timeout: float
    ) -> list[SpanRecord]:
        """The trace's spans once ``done(spans)`` holds, or whatever arrived by ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.stop(grace=None)


def orphans(spans: list[SpanRecord]) -> list[SpanRecord]:
    """Spans whose parent is not among ``spans``."""
    ids = {s.span_id for s in spans}
    return [s for s in spans if s.parent_id and s.parent_id not in ids]


def roots(spans: list[SpanRecord]) -> list[SpanRecord]:
    return [s for s in spans if not s.parent_id]


def env_without_otel(**extra: str) -> dict[str, str]:
    """This process's environment minus every ``OTEL_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, **extra}
