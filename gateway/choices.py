"""Several choices of one prompt (OpenAI's ``n``): independent requests through the pipeline,
each with its own seed stream, sharing the prompt's KV through the instances' prefix caches.

Choice i is an ordinary request with id ``<request id>-<i>`` and seed ``seed + i`` (modulo
2**63; unseeded choices draw from the instances' default generators). Choice 0 runs first; the
others start once its first token is out. By then its prompt is computed and its full pages are
in the prefix cache of the instance that prefilled it (engine ``Scheduler.share_prompt``), so
the later choices that land there compute only the prompt's last partial page. Each choice is
admitted and routed on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from opentelemetry.context import Context

from gateway.core import Delta, GenerationCore, GenerationInput

MAX_CHOICES = 128  # OpenAI's bound on n
SEED_MODULUS = 2**63  # seeds lie in [0, 2**63)


def choice_inputs(inp: GenerationInput, n: int) -> list[GenerationInput]:
    """The ``n`` requests of ``inp``'s choices; ``[inp]`` itself when ``n == 1``."""
    if n == 1:
        return [inp]
    seed = inp.params.seed
    return [
        dataclasses.replace(
            inp,
            request_id=f"{inp.request_id}-{i}",
            params=dataclasses.replace(
                inp.params, seed=None if seed is None else (seed + i) % SEED_MODULUS
            ),
        )
        for i in range(n)
    ]


async def generate_choices(
    core: GenerationCore, inputs: list[GenerationInput], trace_parent: Context | None = None
) -> AsyncIterator[Delta]:
    """Every choice's deltas as they come, each with ``Delta.index`` set; every choice ends
    with a delta that has a ``finish_reason``. A choice that fails fails the whole request:
    the others are cancelled (their pages freed) and its error is raised. Leaving early
    cancels them all."""
    if len(inputs) == 1:
        async for delta in core.generate(inputs[0], trace_parent):
            yield delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    first_out = asyncio.Event()  # choice 0 has its first token, or ended

    async def run(index: int) -> None:
        try:
            if index > 0:
                await first_out.wait()
            async for delta in core.generate(inputs[index], trace_parent):
                if index == 0 and delta.token_ids:
                    first_out.set()
                queue.put_nowait((index, dataclasses.replace(delta, index=index)))
            queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
        finally:
            if index == 0:
                first_out.set()

    tasks = [asyncio.create_task(run(i)) for i in range(len(inputs))]
    try:
        running = len(tasks)
        while running:
            _, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
