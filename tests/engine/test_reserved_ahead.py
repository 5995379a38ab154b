"""``SchedulerStats.num_reserved_ahead_tokens``: the tokens whose pages admission took before
the request had them. Only a ``reserve_all`` request (PD prefill) takes any; one that grows
on demand, admitted or reserved on a decode instance, takes none."""

from __future__ import annotations

from dsmesh.engine.kv.pool import PageAllocator
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def test_only_reserve_all_requests_reserve_ahead() -> None:
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), PageAllocator(16))
    sched.add(Request("grows", [1, 2, 3], GREEDY, max_total_tokens=12))
    sched.schedule()
    sched.reserve(Request("decode", [1, 2], GREEDY, max_total_tokens=10))
    assert sched.stats().num_reserved_ahead_tokens == 0
    sched.add(Request("prefill", [1, 2, 3], GREEDY, max_total_tokens=4, reserve_all=True))
    sched.schedule()
    assert sched.stats().num_reserved_ahead_tokens == 1  # its first new token
