"""The controller's policy without the network: windows, decisions, versions."""

from __future__ import annotations

import pytest
import torch

from dsmesh.eplb_svc.algorithm import balancedness, predicted_rank_load, rebalance_experts
from dsmesh.eplb_svc.controller import Controller, InvalidLoad, decide
from tests.eplb.conftest import SHAPE, sample, skewed_counts, trivial_placement


def test_window_keeps_the_last_steps_in_logical_terms() -> None:
    c = Controller(window_steps=20)
    trivial = trivial_placement()
    loads = [skewed_counts(seed) for seed in range(4)]
    c.report(sample(loads[0], trivial, steps=10))
    c.report(sample(loads[1], trivial, steps=10))
    state = c.instances["decode-0"]
    assert torch.equal(state.window.logical_load(), loads[0] + loads[1])
    c.report(sample(loads[2], trivial, steps=10))  # the first sample leaves: 20 steps remain
    assert state.window.num_steps == 20
    assert torch.equal(state.window.logical_load(), loads[1] + loads[2])
    # under another placement the physical ids change, the logical load does not
    other = rebalance_experts(loads[3], SHAPE.num_physical, 1, 1, SHAPE.ep_size)[0]
    c.report(sample(loads[3], other, steps=10))
    assert torch.equal(state.window.logical_load(), loads[2] + loads[3])


def test_decide_applies_only_above_the_threshold() -> None:
    load, trivial = skewed_counts(1), trivial_placement()
    d = decide(load, trivial, SHAPE, threshold=0.05)
    want = rebalance_experts(load, SHAPE.num_physical, 1, 1, SHAPE.ep_size)[0]
    assert torch.equal(d.physical_to_logical, want)
    assert d.before == balancedness(predicted_rank_load(load, trivial, SHAPE.ep_size))
    assert d.after == balancedness(predicted_rank_load(load, want, SHAPE.ep_size))
    assert d.gain > 0.05 and d.apply
    again = decide(load, want, SHAPE, threshold=0.05)  # already balanced: no gain
    assert again.gain == 0.0 and not again.apply
    assert decide(load, want, SHAPE, threshold=0.05, force=True).apply
    assert not decide(load, trivial, SHAPE, threshold=d.gain).apply  # strictly above


def test_versions_and_restart_adoption() -> None:
    c = Controller(window_steps=100)
    load, trivial = skewed_counts(2), trivial_placement()
    c.report(sample(load, trivial))
    d = decide(*c.snapshot("decode-0"), threshold=0.0)
    assert c.commit("decode-0", d) == 1
    assert torch.equal(c.instances["decode-0"].placement, d.physical_to_logical)
    assert c.report(sample(load, d.physical_to_logical, applied_version=1, swap_s=0.1))
    assert not c.report(sample(load, d.physical_to_logical, applied_version=1))
    # a controller that restarted adopts the instance's version and placement
    fresh = Controller(window_steps=100)
    fresh.report(sample(load, d.physical_to_logical, applied_version=7))
    assert fresh.instances["decode-0"].version == 7
    assert torch.equal(fresh.instances["decode-0"].placement, d.physical_to_logical)


def test_bad_samples_name_the_field() -> None:
    c = Controller(window_steps=100)
    load, trivial = skewed_counts(0), trivial_placement()
    c.report(sample(load, trivial))
    bad = trivial.clone()
    bad[1, :] = 0  # logical experts 1.. lose every replica
    with pytest.raises(InvalidLoad, match="physical_to_logical") as info:
        c.report(sample(load, bad))
    assert info.value.field == "physical_to_logical"
    with pytest.raises(InvalidLoad, match="window_steps"):
        c.report(sample(load, trivial, steps=-1))
    with pytest.raises(InvalidLoad, match="instance_id"):
        c.report(sample(load, trivial, instance_id=""))
    with pytest.raises(ValueError, match="window_steps"):
        Controller(window_steps=0)
