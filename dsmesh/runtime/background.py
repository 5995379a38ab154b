"""Fire-and-forget tasks a servicer starts (cleanups, broker notices), kept referenced until
done and awaited on shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for every task, including ones started while waiting."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
