"""An instance's link to kv_broker: the Attach stream (liveness + events) and the stub.

The Attach stream is re-opened whenever it drops, so a restarted broker sees every instance
again without restarting it. Events for handoffs arrive on the event loop through
``on_event``; losing an established stream calls every ``on_lost`` listener (the broker's
handoff records may be gone with it: a restarted broker starts empty). Both are given to the
constructor: a servicer that calls the broker takes a stub on the same ``channel``, built
before the link, and the link is built after it with the servicer's handlers. The stream lives as
long as the process, so it is not traced
(``dsmesh.runtime.telemetry.UNTRACED_METHOD_PREFIXES``); the stub's other calls are, in the
caller's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from dsmesh.runtime import grpc_server
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)

EventHandler = Callable[[kb.BrokerEvent], None]
LostHandler = Callable[[str], None]  # called with why the stream ended


class BrokerLink:
    """``channel``: a channel to ``address`` that others share (the link closes it); by
    default the link opens its own."""

    def __init__(
        self,
        address: str,
        instance: kb.Instance,
        on_event: EventHandler | None = None,
        on_lost: Sequence[LostHandler] = (),
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.address = address
        self.instance = instance
        self.on_event = on_event
        self.on_lost = tuple(on_lost)
        self.channel = channel if channel is not None else grpc_server.channel(address)
        self.stub = kb_grpc.KVBrokerStub(self.channel)
        self.attached = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._attach_loop(), name="broker-attach")

    async def wait_attached(self, timeout: float) -> bool:
        return await wait_set(self.attached, timeout)

    async def _attach_loop(self) -> None:
        backoff = 0.1
        while not self._closed:
            call = self.stub.Attach(kb.AttachRequest(instance=self.instance))
            why = "kv_broker ended the stream"
            try:
                async for event in call:
                    if not self.attached.is_set():
                        log.info("attached to kv_broker at %s", self.address)
                        self.attached.set()
                        backoff = 0.1
                    if not event.heartbeat and self.on_event is not None:
                        self.on_event(event)
            except grpc.aio.AioRpcError as exc:
                if self._closed:
                    return
                why = f"kv_broker stream lost ({exc.code().name})"
                log.warning("%s; re-attaching", why)
            except asyncio.CancelledError:
                call.cancel()
                raise
            if self.attached.is_set():
                self.attached.clear()
                for listener in self.on_lost:
                    try:
                        listener(why)
                    except Exception:  # a listener must not stop the re-attaching
                        log.exception("kv_broker on_lost listener failed")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.channel.close()
