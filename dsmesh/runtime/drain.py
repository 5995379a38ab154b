"""Admission of a service's calls, and the drain that ends it.

While open, every call runs. Once :meth:`Drain.start` is called (SIGTERM), calls of the
``refused`` methods - those that bring new work, e.g. ``Decode`` or ``GetLoad`` - get
UNAVAILABLE, so routers stop choosing the service; every other method keeps working, because
the work already accepted may need it (``Abort``, a handoff's ``Commit``). The drain waits
until the calls in flight have finished, except the ``untracked`` ones: long-lived streams
that last as long as their peer (kv_broker's ``Attach``, EPLB's watches).

The same object admits HTTP requests (:meth:`track`, :attr:`draining`), so the gateway's two
front doors drain together.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

import grpc

from dsmesh.runtime.waits import wait_set

DRAINING_MESSAGE = "the service is draining (shutting down); retry on another instance"


class Drain:
    def __init__(self, refused: Iterable[str] = (), untracked: Iterable[str] = ()) -> None:
        """Method names are full gRPC paths, ``/dsmesh.v1.Decode/Decode``."""
        self.refused = frozenset(refused)
        self.untracked = frozenset(untracked)
        self.draining = False
        self.in_flight = 0
        self._changed = asyncio.Event()

    def start(self) -> None:
        self.draining = True
        self._changed.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one call (or HTTP request) in flight for the duration of the block."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._changed.set()

    async def wait_idle(self, timeout_s: float, busy: Callable[[], int] = lambda: 0) -> bool:
        """Wait until no tracked call is in flight and ``busy()`` (work that is not a call,
        e.g. kv_broker's live handoffs) is 0; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight or busy():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            # busy() changes without telling: look again at least every 50 ms
            await wait_set(self._changed, min(left, 0.05))
        return True

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _DrainInterceptor(self)


class _DrainInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, drain: Drain) -> None:
        self.drain = drain

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        if self.drain.draining and method in self.drain.refused:
            return _wrap(handler, _refuse)
        if method in self.drain.untracked:
            return handler
        return _wrap(handler, lambda behavior: _tracked(behavior, self.drain))


async def _refuse_call(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)


def _refuse(behavior: Callable) -> Callable:
    return _refuse_call


def _tracked(behavior: Callable, drain: Drain) -> Callable:
    """``behavior`` counted in flight while it runs: a coroutine, or an async generator."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request_or_iterator, context):
            with drain.track():
                async for item in behavior(request_or_iterator, context):
                    yield item

        return stream

    async def call(request_or_iterator, context):
        with drain.track():
            return await behavior(request_or_iterator, context)

    return call


def _wrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable]):
    """A handler of the same kind as ``handler`` whose behaviour is ``wrap(behaviour)``."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **codec)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **codec)
