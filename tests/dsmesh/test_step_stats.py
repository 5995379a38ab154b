"""The engine's periodic step summary, and the worker's batched stream delivery."""

from __future__ import annotations

import asyncio

from dsmesh.engine.llm_engine import StepOutput
from dsmesh.instance.step_stats import StepStats
from dsmesh.instance.worker import drain_outputs


def decode_row(rid: str, pos: int) -> StepOutput:
    return StepOutput(rid, [7], False, None, (pos, pos + 1))


def test_steps_are_classed_by_what_they_ran() -> None:
    stats = StepStats(interval_s=10.0)
    stats.add(0.010, [decode_row("a", 5), decode_row("b", 9)], now=1.0)
    stats.add(0.200, [decode_row("a", 6), StepOutput("c", [], False, None, (0, 512))], now=1.2)
    stats.add(0.100, [StepOutput("d", [3], False, None, (0, 1000))], now=1.3)
    stats.add(0.050, [], now=1.35)  # an idle forward of an EP rank: nothing to class
    assert stats.report(now=5.0) is None  # not 10 s yet
    line = stats.report(now=10.99)
    assert line == (
        "engine: 10.0 s, busy 3%: decode 1 x 10.0 ms, 2.0 rows; mixed 1 x 200.0 ms, 1.0 rows, "
        "512 prompt tokens; prefill 1 x 100.0 ms, 1000 prompt tokens; 0 tokens/s out, "
        "151 prompt tokens/s"
    )
    assert stats.report(now=30.0) is None  # a new period starts at the next step


def test_a_stream_that_fell_behind_catches_up_in_one_message() -> None:
    async def main() -> None:
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        for i, tok in enumerate((11, 12, 13)):
            q.put_nowait(StepOutput("r", [tok], False, None, (i, i + 1)))
        q.put_nowait(StepOutput("r", [14], True, "length", (3, 4)))
        q.put_nowait(StepOutput("r", [99], False, None, (4, 5)))  # never read past the end
        merged = drain_outputs(await q.get(), q)
        assert merged == StepOutput("r", [11, 12, 13, 14], True, "length", (3, 4))
        assert q.qsize() == 1
        alone = StepOutput("s", [5], False, None, (0, 1))
        assert drain_outputs(alone, asyncio.Queue()) is alone

    asyncio.run(main())
