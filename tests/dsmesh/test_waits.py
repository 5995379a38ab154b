"""dsmesh/runtime/waits.py: a time-limited wait that never swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from dsmesh.runtime.waits import wait_set


def test_set_and_timeout() -> None:
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_set(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return timed_out, await wait_set(event, 10.0)

    assert asyncio.run(main()) == (False, True)


def test_a_cancel_as_the_event_is_set_propagates() -> None:
    """Python 3.11's ``asyncio.wait_for`` returns normally here (python/cpython#86296)."""

    async def main() -> None:
        event = asyncio.Event()
        waiting = asyncio.ensure_future(wait_set(event, 10.0))
        await asyncio.sleep(0)  # the wait has begun
        event.set()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
