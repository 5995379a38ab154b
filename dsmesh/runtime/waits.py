"""Waiting for an event with a time limit, without losing a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns normally when its task is cancelled in the same
loop iteration as the awaited event is set: the cancellation is swallowed
(python/cpython#86296, fixed in 3.12). A Decode call cancelled by its client as its pages
came free then went on as if nobody had cancelled it. ``asyncio.timeout`` tells its own
deadline apart from a cancellation, so every time-limited wait goes through here.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, for at most ``timeout_s`` seconds; whether it was set.
    A cancellation of the caller always propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
