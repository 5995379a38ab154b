"""dsmesh.bench.ep_gpu's ``--graphs`` run on CPU (--tiny, EP 2 over gloo): every rank decodes
through the graph runner (uncaptured on CPU) in steps the group agreed, TBO off and on."""

from __future__ import annotations

import json

import pytest
import torch

from dsmesh.bench import ep_gpu

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (on GPUs: the bench)"),
]


def test_ep2_graphs_run_decodes_through_the_runner_on_every_rank(tmp_path) -> None:
    out = tmp_path / "ep.json"
    argv = ["bench", "--tiny", "--ep-size", "2", "--graphs", "--decode-batch", "4"]
    argv += ["--context", "64", "--steps", "2", "--prefill-prompts", "1", "--prompt-len", "32"]
    assert ep_gpu.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["graphs"] and len(result["ranks"]) == 2
    for row in result["ranks"]:
        # TBO off and on: 3 warm-up and 2 timed decode steps each, all on the runner
        assert (row["runner_replays"], row["runner_eager"]) == (0, 10)
    for key in ("no_tbo", "tbo"):
        assert result[key]["decode_step_ms"] > 0 and result[key]["decode_tokens_per_s_per_gpu"] > 0
