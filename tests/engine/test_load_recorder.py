"""The expert load recorder counts routed tokens per physical expert over a window."""

from __future__ import annotations

import torch

from dsmesh.engine.ep.load_recorder import ExpertLoadRecorder
from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.tiny_model import make_tiny_model


def test_window_counts() -> None:
    rec = ExpertLoadRecorder(num_moe_layers=2, num_physical=4, window_steps=2)
    rec.record(0, torch.tensor([[0, 1], [1, 3]]))
    rec.end_step()
    rec.record(1, torch.tensor([[2, 2]]))
    rec.end_step()
    assert rec.window().tolist() == [[1, 2, 0, 1], [0, 0, 2, 0]]
    rec.end_step()  # an empty step pushes the first one out of the window
    assert rec.window().tolist() == [[0, 0, 0, 0], [0, 0, 2, 0]]
    assert rec.num_steps == 2
    exported = rec.export()
    assert exported["tokens_per_expert"] == [[0, 0, 0, 0], [0, 0, 2, 0]]
    assert exported["window_steps"] == 2 and exported["num_physical_experts"] == 4


def test_model_records_every_routed_token(tmp_path) -> None:
    model = load_model(make_tiny_model(tmp_path / "m"))
    cfg = model.config
    rec = ExpertLoadRecorder(len(cfg.moe_layer_ids), cfg.moe.n_routed_experts)
    for layer in model.moe_layers():
        layer.load_recorder = rec
    pool = MLAKVPool(cfg.num_hidden_layers, 16, 4, cfg.mla.kv_cache_dim, torch.float32)
    batch = ForwardBatch.build(
        [SequenceChunk(list(range(10)), 0, torch.tensor(pool.allocator.allocate(3)))], 4, "cpu"
    )
    model(batch, pool)
    rec.end_step()
    load = rec.window()
    assert load.shape == (len(cfg.moe_layer_ids), cfg.moe.n_routed_experts)
    assert load.sum(dim=1).tolist() == [10 * cfg.moe.num_experts_per_tok] * load.shape[0]
    assert (load > 0).sum() > load.shape[0]  # spread over several experts
