"""dsmesh.bench.ep_graphs on CPU (--tiny, EP size 1 over gloo): every block runs, the graph-runner
blocks (uncaptured on CPU) launch decode steps ahead, the EP one through the group's host
vote, and the eager blocks do not."""

from __future__ import annotations

import pytest
import torch

from dsmesh.bench import ep_graphs

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (on GPUs: the bench)"),
]


def test_ep_graphs_blocks_run_and_the_group_launches_ahead() -> None:
    out = ep_graphs.main(["--tiny", "--device", "cpu", "--batches", "2", "--steps", "4"])
    row = out["batches"][2]
    for name in ("graphs", "eager", "ep_graphs", "ep_eager", "ep_local_graphs", "ep_tbo_eager"):
        assert row[f"{name}_ms"] > 0, name
    # 3 warm-up and 4 timed steps of 2 requests: the runner's steps after the first
    # launch ahead, in the group too (agreed by the host vote)
    assert row["graphs_launched_ahead"] >= 4 and row["ep_graphs_launched_ahead"] >= 4, row
    assert row["eager_launched_ahead"] == 0 and row["ep_eager_launched_ahead"] == 0, row
