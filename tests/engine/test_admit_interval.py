"""``admit_interval``: while requests decode, waiting requests join every N steps, so several
arrivals share one prompt forward. Admission timing changes; tokens do not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.kv.pool import PageAllocator
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    chunks = sched.schedule()
    for c in chunks:
        c.request.num_computed += c.num_tokens
        if c.request.num_computed == c.request.num_tokens:
            c.request.output_ids.append(7)
    return [(c.request.request_id, c.num_tokens) for c in chunks]


def test_arrivals_wait_for_the_interval_while_requests_decode() -> None:
    sched = Scheduler(SchedulerConfig(page_size=4, admit_interval=3), PageAllocator(64))
    sched.add(Request("a", [1, 2, 3], GREEDY, max_total_tokens=40))
    assert _step(sched) == [("a", 3)]  # nothing decodes: admitted at once
    sched.add(Request("b", [4, 5], GREEDY, max_total_tokens=40))
    assert _step(sched) == [("a", 1)]  # 1 step since a's admission
    sched.add(Request("c", [6], GREEDY, max_total_tokens=40))
    assert _step(sched) == [("a", 1)]  # 2
    assert _step(sched) == [("a", 1), ("b", 2), ("c", 1)]  # 3: both join one forward
    sched.add(Request("d", [8, 9], GREEDY, max_total_tokens=40))
    assert _step(sched) == [("a", 1), ("b", 1), ("c", 1)]
    assert _step(sched) == [("a", 1), ("b", 1), ("c", 1)]
    assert _step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 2)]


def test_an_interval_of_one_admits_every_step() -> None:
    sched = Scheduler(SchedulerConfig(page_size=4), PageAllocator(64))
    sched.add(Request("a", [1, 2, 3], GREEDY, max_total_tokens=40))
    _step(sched)
    sched.add(Request("b", [4, 5], GREEDY, max_total_tokens=40))
    assert _step(sched) == [("a", 1), ("b", 2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3"))


def test_tokens_do_not_depend_on_the_interval(model) -> None:
    """Requests arriving while others decode (greedy and seeded sampling) get the same
    tokens whether they join at once or every 4 steps."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 12, 3, 20, 9)]
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_new_tokens=10, ignore_eos=True),
        SamplingParams(max_new_tokens=15, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=9, max_new_tokens=8, ignore_eos=True),
        SamplingParams(max_new_tokens=11, ignore_eos=True),
    ]
    base = EngineConfig(device="cpu", page_size=4, max_total_tokens=2048)

    def run(interval: int) -> tuple[dict[int, list[int]], int]:
        engine = LLMEngine(dataclasses.replace(base, admit_interval=interval), model=model)
        ids: dict[str, int] = {}
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        waited = 0  # steps after which an arrival still waited
        for step in range(200):
            if step < len(prompts):  # one arrival per step
                ids[engine.add_request(prompts[step], params[step])] = step
            for o in engine.step():
                out[ids[o.request_id]].extend(o.new_token_ids)
            waited += bool(engine.scheduler.waiting)
            if step >= len(prompts) and not engine.has_unfinished():
                break
        assert engine.num_pages_in_use == 0
        return out, waited

    every, waited_every = run(1)
    grouped, waited_grouped = run(4)
    assert (waited_every, waited_grouped >= 3) == (0, True)
    assert grouped == every
    assert all(len(every[i]) == p.max_new_tokens for i, p in enumerate(params))
