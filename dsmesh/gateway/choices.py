"""Several choices of one prompt (OpenAI's ``n``): independent requests through the pipeline,
each with its own seed stream, sharing the prompt's KV through the instances' prefix caches.

Choice i is an ordinary request with id ``<request id>-<i>`` and seed ``seed + i`` (modulo
2**63; unseeded choices draw from the instances' default generators). Choice 0 runs first; the
others start once its first token is out. By then its prompt is computed and its full pages are
in the prefix cache of the instance that prefilled it (engine ``Scheduler.share_prompt``), so
the later choices that land there compute only the prompt's last partial page. Each choice is
admitted and routed on its own. Prompt logprobs are the same for every choice: only choice 0
computes them (a request owing them takes no prefix-cache hit), and its first delta carries
them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
from opentelemetry.context import Context

from dsmesh.gateway.core import Delta, GatewayError, GenerationCore, GenerationInput
from dsmesh.gateway.request import ChoiceGroup

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
                inp.params,
                seed=None if seed is None else (seed + i) % SEED_MODULUS,
                prompt_logprobs=inp.params.prompt_logprobs if i == 0 else None,
            ),
        )
        for i in range(n)
    ]


async def generate_choices(
    core: GenerationCore,
    inputs: list[GenerationInput],
    trace_parent: Context | None = None,
    group: ChoiceGroup | None = None,
    per_prompt: int = 0,
) -> AsyncIterator[Delta]:
    """Every choice's deltas as they come, each with ``Delta.index`` set; every choice ends
    with a delta that has a ``finish_reason``. ``per_prompt``: a batch of prompts, each with
    that many consecutive choices, each prompt's first choice leading its others (0: one
    prompt). A choice that fails fails the whole request:
    the others are cancelled (their pages freed) and its error is raised. Leaving early
    cancels them all. A choice of an aborted ``group`` that has not started ends "abort"."""
    if len(inputs) == 1:
        async for delta in core.generate(inputs[0], trace_parent):
            yield delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    per = per_prompt or len(inputs)
    # per prompt: its first choice has its first token, or ended
    first_out = [asyncio.Event() for _ in range(0, len(inputs), per)]

    def aborted(index: int) -> None:
        prompt = len(inputs[index].prompt_ids)
        queue.put_nowait((index, Delta([], "", "abort", prompt, 0, index=index)))
        queue.put_nowait((index, None))

    async def run(index: int) -> None:
        lead = index % per == 0
        try:
            if not lead:
                await first_out[index // per].wait()
                if group is not None and group.aborted:
                    aborted(index)
                    return
            # no await from the check above to its registration in core.active: an Abort
            # finds it there
            async for delta in core.generate(inputs[index], trace_parent):
                if lead and delta.token_ids:
                    first_out[index // per].set()
                queue.put_nowait((index, dataclasses.replace(delta, index=index)))
            queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except GatewayError as exc:
            # aborted in its KV handoff, which PD answers CANCELLED: an abort all the same
            if group is not None and group.aborted and exc.code == grpc.StatusCode.CANCELLED:
                aborted(index)
            else:
                queue.put_nowait((index, exc))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
        finally:
            if lead:
                first_out[index // per].set()

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
