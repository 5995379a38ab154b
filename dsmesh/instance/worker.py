"""Runs an :class:`LLMEngine` on its own thread, driven from asyncio.

The engine is not thread-safe and its forward blocks, so one thread owns it: it runs queued
commands between steps and steps while there is work. Servicers on the event loop submit
commands with :meth:`EngineWorker.call` and receive per-request step outputs through
listeners, which run on the engine thread (keep them short), or through queues on their
event loop (:meth:`EngineWorker.stream`): one loop wake-up per step carries every stream's
output, instead of one per request, which would load the loop (and the GIL the engine
thread needs) in proportion to the batch.

Every ``stats_interval_s`` the worker logs where its time went (dsmesh/instance/step_stats.py).

In an expert-parallel group every rank's worker steps in lockstep: each loop the ranks vote
(``group_vote``, one all-reduce) whether any of them has work, and if so all of them step,
the idle ones with an empty forward, so the MoE collectives always pair up. A failed step
there means the group is broken (a peer died, or a collective timed out): ``on_fatal`` is
called and the worker stops, since no rank can step alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dsmesh.engine.llm_engine import LLMEngine, StepOutput
from dsmesh.instance.step_stats import StepStats

if TYPE_CHECKING:
    from dsmesh.engine.ep.runtime import GroupVote


class GroupHook(Protocol):
    """Work an EP group does between forwards, in lockstep (e.g. :class:`GroupEPLB`)."""

    def vote_flags(self) -> list[int]: ...

    def after_vote(self, flags: list[int]) -> None: ...

    def after_step(self) -> None: ...


log = logging.getLogger(__name__)
T = TypeVar("T")
Listener = Callable[[StepOutput], None]


@dataclass(frozen=True)
class _Stream:
    """A request's outputs go to ``queue``, on ``loop``'s thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]


def _put_all(items: list[tuple[asyncio.Queue[StepOutput], StepOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def drain_outputs(first: StepOutput, outputs: asyncio.Queue[StepOutput]) -> StepOutput:
    """``first`` merged with every output already queued behind it (their tokens, logprobs
    and prompt logprobs in order, the last one's finish and speculation counts): a stream
    that fell behind catches up in one message."""
    if outputs.empty():
        return first
    tokens = list(first.new_token_ids)
    logprobs = None if first.logprobs is None else list(first.logprobs)
    prompt = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
    last = first
    spec = first.spec_counts
    while not outputs.empty() and not last.finished:
        last = outputs.get_nowait()
        spec = last.spec_counts or spec
        tokens += last.new_token_ids
        if last.logprobs is not None:
            logprobs = (logprobs or []) + last.logprobs
        if last.prompt_logprobs is not None:
            prompt = (prompt or []) + last.prompt_logprobs
    return StepOutput(
        last.request_id,
        tokens,
        last.finished,
        last.finish_reason,
        last.computed,
        logprobs,
        prompt,
        spec,
    )


class EngineWorker:
    def __init__(
        self,
        engine: LLMEngine,
        name: str = "engine",
        group_vote: GroupVote | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        group_hook: GroupHook | None = None,
        idle_poll_s: float = 0.005,
        stats_interval_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.name = name
        self.group_vote = group_vote
        self.on_fatal = on_fatal
        self.group_hook = group_hook
        self.idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Callable]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._listeners: dict[str, Listener | _Stream] = {}
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.stats = StepStats(stats_interval_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; exceptions propagate."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def resolve(ok: bool, value: Any) -> None:
            def settle() -> None:
                if future.done():
                    return
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

            loop.call_soon_threadsafe(settle)

        self._commands.put((fn, resolve))
        self._wake.set()
        return await future

    def listen(self, request_id: str, listener: Listener) -> None:
        """Deliver this request's step outputs to ``listener`` (on the engine thread).

        Call it from a command (``call``) before the request can produce output, so no
        output is missed; it is dropped automatically after the finishing output.
        """
        self._listeners[request_id] = listener

    def stream(self, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[StepOutput]:
        """Like :meth:`listen`, but the outputs arrive in the returned queue on ``loop``
        (batched with the other streams of that loop, one wake-up per step)."""
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._listeners[request_id] = _Stream(loop, outputs)
        return outputs

    def unlisten(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def abort_request(self, engine: LLMEngine, request_id: str, reason: str = "abort") -> bool:
        """Engine thread (inside :meth:`call`): abort and tell the request's listener, so a
        stream waiting for its next token ends instead of hanging."""
        aborted = engine.abort(request_id)
        listener = self._listeners.pop(request_id, None)
        out = StepOutput(request_id, [], True, reason)
        if isinstance(listener, _Stream):
            listener.loop.call_soon_threadsafe(listener.queue.put_nowait, out)
        elif listener is not None:
            listener(out)
        return aborted

    def _run_commands(self) -> None:
        while True:
            try:
                fn, resolve = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                resolve(True, fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                resolve(False, exc)

    def _main(self) -> None:
        if self.group_vote is not None:
            self._main_group()
            return
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_unfinished():
                if self._capture_graph():
                    continue  # one graph per idle gap, then the commands again
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting the running batch")
                self._abort_all("engine error")
                continue
            self._deliver(outputs)
            self._count(start, outputs)
            self._capture_graph()

    def _capture_graph(self) -> bool:
        """A decode graph queued for after ready, captured if one is due (LLMEngine.
        capture_deferred_graph); a failure is logged and decode goes on uncaptured."""
        try:
            return self.engine.capture_deferred_graph()
        except Exception:
            log.exception("capturing a decode graph after ready failed")
            return False

    def _main_group(self) -> None:
        assert self.group_vote is not None
        try:
            hook = self.group_hook
            while not self._stop.is_set():
                self._run_commands()
                flags = hook.vote_flags() if hook is not None else []
                busy, flags = self.group_vote.vote(self.engine.has_unfinished(), flags)
                if hook is not None:
                    hook.after_vote(flags)  # collective: EPLB placements, load, swaps
                if not busy:
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = self.engine.step(idle_forward=True)
                self._deliver(outputs)
                self._count(start, outputs)
                if hook is not None:
                    hook.after_step()
        except BaseException as exc:  # noqa: BLE001 - the group cannot go on
            if self._stop.is_set():
                return  # peers left first while this rank was stopping
            log.critical("expert-parallel step failed; this rank stops: %s", exc)
            self._abort_all("engine error")
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        self.num_steps += 1
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            listener = self._listeners.get(out.request_id)
            if listener is None:
                continue
            if out.finished:
                self._listeners.pop(out.request_id, None)
            if isinstance(listener, _Stream):
                batches.setdefault(listener.loop, []).append((listener.queue, out))
                continue
            try:
                listener(out)
            except Exception:
                log.exception("listener for %s failed", out.request_id)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: its streams are gone
                log.debug("event loop closed; %d outputs dropped", len(items))

    def _count(self, start: float, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        self.stats.add(now - start, outputs, now)
        line = self.stats.report(now)
        if line is not None:
            log.info("%s", line)

    def _abort_all(self, reason: str) -> None:
        for request_id in list(self.engine.requests):
            self.abort_request(self.engine, request_id, reason)
