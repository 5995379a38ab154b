"""OpenTelemetry tracing for every dsmesh process: set up once at start, off by default.

Tracing is on when the standard environment asks for an exporter (:func:`exporter_names`):
``OTEL_TRACES_EXPORTER`` (``otlp`` and/or ``console``), or else an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); never with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. The SDK reads the rest itself:
endpoint, headers, TLS and timeout (``OTEL_EXPORTER_OTLP_*``), batching (``OTEL_BSP_*``),
sampling (``OTEL_TRACES_SAMPLER``), extra resource attributes (``OTEL_RESOURCE_ATTRIBUTES``).
Off, nothing is installed: :func:`tracer` is the API's no-op tracer and there are no gRPC
interceptors.

One trace per request: the caller (gateway, or a test) opens the root span; the interceptors
from :func:`client_interceptors` / :func:`server_interceptors` (installed by
``dsmesh.runtime.grpc_server.channel`` and ``start_server``) carry it between processes as a W3C
``traceparent`` in gRPC metadata, with a CLIENT and a SERVER span per RPC. Inside a process,
work done on other threads (the engine, the KV transfer thread) gets the request's context
explicitly: capture :func:`current_context` in the handler, then either :func:`record_span`
(a finished span with explicit times, which can neither leak nor be left open) or
:func:`attached` on that thread.

Spans besides the RPCs (times are ``time.time_ns()``):

- prefill: ``prefill.queue`` (submit to the first forward that includes the request),
  ``prefill.chunk`` per forward (``dsmesh.chunk.tokens/start/end``), ``kv.transfer`` per chunk
  write (``dsmesh.kv.bytes/pages/segments``, ``dsmesh.kv.tokens_done``), ``kv.commit``.
- kv-broker: ``kv.handoff`` from Reserve to the handoff's terminal state
  (``dsmesh.handoff.state``, ``dsmesh.kv.bytes``).
- decode: ``decode.wait_kv`` (Reserve until the handoff ends), ``decode.generate``
  (activation to the last token: ``dsmesh.prompt_tokens``, ``dsmesh.completion_tokens``,
  ``dsmesh.finish_reason``).

The tracer provider is process-global (OpenTelemetry's design): the first
:func:`setup_tracing` that finds tracing requested installs it, later ones share it (several
services in one process, as in tests), and the matching last :func:`shutdown_tracing` flushes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console")
# Probes, load polls and the long-lived Attach stream (one span per process lifetime) carry
# no request; tracing them would bury the request traces under a poll every 250 ms.
UNTRACED_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/dsmesh.v1.KVBroker/Attach",
    "/dsmesh.v1.KVBroker/ListInstances",
    "/dsmesh.v1.Prefill/GetLoad",
    "/dsmesh.v1.Decode/GetLoad",
    "/dsmesh.v1.EPLB/ReportLoad",  # an EP group's streams to eplb: open while it lives
    "/dsmesh.v1.EPLB/WatchPlacement",
)
_NOOP_TRACER = trace.NoOpTracer()

try:
    SERVICE_VERSION = version("dsmesh")
except PackageNotFoundError:  # pragma: no cover - running from a plain checkout
    SERVICE_VERSION = "0+unknown"


@dataclass
class _Tracing:
    service_name: str
    provider: Any  # opentelemetry.sdk.trace.TracerProvider (the SDK is imported lazily)
    tracer: trace.Tracer
    users: int = 1  # setup_tracing calls not yet matched by shutdown_tracing


_active: _Tracing | None = None
_lock = threading.Lock()


# ---- set-up -------------------------------------------------------------------------------


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters ``environ`` asks for (subset of :data:`EXPORTERS`); empty = off.

    Unknown names in ``OTEL_TRACES_EXPORTER`` are logged and skipped.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    requested = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not requested:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names: list[str] = []
    for name in (n.strip() for n in requested.split(",")):
        if name in EXPORTERS and name not in names:
            names.append(name)
        elif name and name != "none":
            log.warning("OTEL_TRACES_EXPORTER: unsupported exporter %r ignored", name)
    return names


@contextlib.asynccontextmanager
async def tracing(service_name: str) -> AsyncIterator[bool]:
    """A service's whole life with tracing: :func:`setup_tracing` first (before any server or
    channel exists), the process's last spans flushed at the end. Yields whether it is on."""
    traced = setup_tracing(service_name)
    try:
        yield traced
    finally:
        if traced:
            await asyncio.to_thread(shutdown_tracing)


def setup_tracing(service_name: str) -> bool:
    """Install the tracer provider for this process if the environment asks for tracing.

    ``service_name`` ("gateway", "prefill", "decode", "kv-broker") becomes the resource's
    ``service.name`` unless ``OTEL_SERVICE_NAME`` is set. Call it before creating gRPC servers
    and channels (their interceptors are chosen when they are made). Returns whether tracing
    is on; while on, a later call shares the first set-up (and its ``service.name``).
    """
    global _active
    with _lock:
        if _active is not None:
            _active.users += 1
            if _active.service_name != service_name:
                log.info("%s shares tracing set up as %r", service_name, _active.service_name)
            return True
        names = exporter_names(os.environ)
        if not names:
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME", "").strip() or service_name
        resource = Resource.create({"service.name": name, "service.version": SERVICE_VERSION})
        provider = TracerProvider(resource=resource)
        for exporter in names:
            provider.add_span_processor(BatchSpanProcessor(_make_exporter(exporter)))
        trace.set_tracer_provider(provider)
        _active = _Tracing(name, provider, provider.get_tracer("dsmesh", SERVICE_VERSION))
        log.info("tracing on: service.name=%s, exporters %s", name, ",".join(names))
        return True


def _make_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol.startswith("http"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.error(
                "OTLP protocol %r needs opentelemetry-exporter-otlp-proto-http; using gRPC",
                protocol,
            )
        else:
            return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Export what is buffered and stop the exporters (graceful stop), once every
    :func:`setup_tracing` that turned tracing on has been matched. Blocks at most ``timeout_s``
    even when the collector is unreachable; a no-op when tracing is off."""
    global _active
    with _lock:
        active = _active
        if active is None:
            return
        active.users -= 1
        if active.users > 0:
            return
        _active = None
    worker = threading.Thread(target=active.provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("trace export did not finish within %.1fs; spans may be lost", timeout_s)


def enabled() -> bool:
    return _active is not None


def tracer() -> trace.Tracer:
    """dsmesh's tracer: the SDK's when tracing is on, the no-op tracer otherwise."""
    active = _active
    return active.tracer if active is not None else _NOOP_TRACER


# ---- gRPC ---------------------------------------------------------------------------------


def _traced(details: Any) -> bool:
    method = details.method
    if isinstance(method, bytes):  # grpc.aio client details carry bytes (grpc/grpc#31092)
        method = method.decode()
    return not method.startswith(UNTRACED_METHOD_PREFIXES)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: a SERVER span per RPC, continuing the
    caller's trace from the metadata. Empty when tracing is off."""
    active = _active
    if active is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(active.provider, filter_=_traced)]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For ``grpc.aio.insecure_channel(interceptors=...)``: a CLIENT span per RPC, child of the
    current span, whose context goes out in the metadata. Empty when tracing is off."""
    active = _active
    if active is None:
        return []
    from opentelemetry.instrumentation.grpc.version import __version__

    otel_tracer = trace.get_tracer(
        "opentelemetry.instrumentation.grpc",
        __version__,
        active.provider,
        schema_url="https://opentelemetry.io/schemas/1.11.0",
    )
    return [cls(otel_tracer, _traced) for cls in _client_interceptor_classes()]


@functools.cache
def _client_interceptor_classes() -> tuple[type, ...]:
    """The instrumentation's aio client interceptors, except that a span is ended when the
    interceptor itself is interrupted: upstream leaves it open when a unary call is cancelled
    before it completes, and the server's spans under it would then have no exported parent.

    And a client-streaming call is handed back as soon as it starts: upstream waits for its
    status first, while ``call.write()`` waits for the call to be handed back, so a call that
    writes its requests (an EP group's load reports to eplb) waited forever."""
    from opentelemetry.instrumentation.grpc import _aio_client

    class EndOnError:
        @contextlib.contextmanager
        def _start_interceptor_span(self, method):
            with super()._start_interceptor_span(method) as span:  # type: ignore[misc]
                try:
                    yield span
                except BaseException as exc:
                    if span.is_recording():
                        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                        span.end()
                    raise

    class StreamUnaryAioClientInterceptor(EndOnError, _aio_client.StreamUnaryAioClientInterceptor):
        async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
            if self.tracing_skipped(client_call_details):
                return await continuation(client_call_details, request_iterator)
            with self._start_interceptor_span(client_call_details.method) as span:
                details = self.propagate_trace_in_details(client_call_details)
                call = await continuation(details, request_iterator)

            def done(call) -> None:  # the call has its status: ending the span waits for none
                asyncio.ensure_future(_end_client_span(span, call))

            call.add_done_callback(done)
            return call

    bases = (
        _aio_client.UnaryUnaryAioClientInterceptor,
        _aio_client.UnaryStreamAioClientInterceptor,
        _aio_client.StreamStreamAioClientInterceptor,
    )
    ours = tuple(type(base.__name__, (EndOnError, base), {}) for base in bases)
    return (*ours[:2], StreamUnaryAioClientInterceptor, ours[2])


async def _end_client_span(span: trace.Span, call: grpc.aio.Call) -> None:
    code = await call.code()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await call.details()}"))
    span.end()


# ---- context across threads ---------------------------------------------------------------


def current_context() -> Context | None:
    """The calling task's trace context, to hand to another thread (None when tracing is
    off, so that carrying it costs nothing)."""
    return otel_context.get_current() if _active is not None else None


def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The trace context carried by incoming HTTP headers (``traceparent``), for a gateway's
    root span: ``tracer().start_as_current_span(name, context=context_from_headers(h))``."""
    return propagate.extract(headers)


@contextlib.contextmanager
def attached(ctx: Context | None) -> Iterator[None]:
    """Make ``ctx`` current on this thread for the block (nothing when ``ctx`` is None)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def record_span(
    name: str,
    parent: Context | None,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    error: str | None = None,
) -> None:
    """Emit a finished span from any thread: a child of the span in ``parent`` (None: of this
    thread's current span), from ``start_ns`` to ``end_ns`` (``time.time_ns()``). ``error``
    sets an ERROR status. Free when tracing is off."""
    active = _active
    if active is None:
        return
    span = active.tracer.start_span(
        name, context=parent, start_time=start_ns, attributes=dict(attributes or {})
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=max(start_ns, end_ns))
