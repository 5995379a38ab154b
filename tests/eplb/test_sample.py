"""From the engine's load recorder to a report the controller accepts."""

from __future__ import annotations

import torch

from dsmesh.clients.eplb import load_report
from dsmesh.engine.ep.load_recorder import ExpertLoadRecorder
from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.eplb_svc.controller import Controller
from dsmesh.eplb_svc.convert import sample_from_report


def test_recorder_take_feeds_the_controller() -> None:
    loc = round_robin_placement(2, 4, 2, 2)  # physical 4, 5 copy logical 0, 1
    rec = ExpertLoadRecorder(num_moe_layers=2, num_physical=6, window_steps=1)
    rec.record(0, torch.tensor([[0, 4], [5, 3]]))
    rec.end_step()
    rec.record(1, torch.tensor([[2, 2]]))
    rec.end_step()
    counts, steps = rec.take()
    assert steps == 2 and counts.tolist() == [[1, 0, 0, 1, 1, 1], [0, 0, 2, 0, 0, 0]]
    assert rec.take()[1] == 0 and rec.num_steps == 1  # take() does not touch the window
    report = load_report("d0", counts, steps, loc.physical_to_logical, 4, 2, num_groups=2)
    sample = sample_from_report(report)  # survives the wire
    c = Controller(window_steps=10)
    c.report(sample)
    assert c.instances["d0"].window.logical_load().tolist() == [[2, 1, 0, 1], [0, 0, 2, 0]]
    assert c.instances["d0"].shape.num_groups == 2
