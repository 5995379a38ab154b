"""Routed experts held in FP8 only (dsmesh/engine/model/build.py ``fp8_only``): no dense copy is
allocated, the checkpoint's FP8 tensors and scales are kept as they are, and a path that would
need the dense weights says so instead of computing garbage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsmesh.bench.checkpoint import write_random_checkpoint
from dsmesh.engine.model.build import build_model, load_model
from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.moe import RoutedExperts
from dsmesh.engine.model.weights import load_weights


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint("tiny-v3", tmp_path_factory.mktemp("fp8"), device="cpu")


def test_no_dense_experts_are_allocated_and_the_fp8_tensors_are_kept(
    fp8_checkpoint: Path,
) -> None:
    cfg = load_config(fp8_checkpoint)
    model = build_model(cfg, torch.bfloat16, "cpu", dense_experts=False)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(not e.has_dense and e.w13.numel() == 0 for e in experts)
    load_weights(model, fp8_checkpoint, keep_fp8=True)
    kept = {n for n in model.fp8_weights if ".mlp.experts." in n}
    assert len(kept) == len(cfg.moe_layer_ids) * cfg.moe.n_routed_experts * 3
    one = model.fp8_weights[next(iter(sorted(kept)))]
    assert one.data.dtype == torch.float8_e4m3fn and one.scale_inv.dtype == torch.float32
    with pytest.raises(RuntimeError, match="held in FP8 only"):
        counts = torch.tensor([2] + [0] * (cfg.moe.n_routed_experts - 1))
        experts[0](torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16), counts)


def test_the_rest_of_the_model_matches_a_dense_load(fp8_checkpoint: Path) -> None:
    dense = load_model(fp8_checkpoint, torch.bfloat16, "cpu")
    cfg = load_config(fp8_checkpoint)
    lean = build_model(cfg, torch.bfloat16, "cpu", dense_experts=False)
    load_weights(lean, fp8_checkpoint, keep_fp8=True)
    ref = dict(dense.named_parameters())
    for name, param in lean.named_parameters():
        if ".mlp.experts.w" in name:
            continue
        assert torch.equal(param, ref[name]), name


def test_fp8_only_applies_on_cuda_alone(fp8_checkpoint: Path) -> None:
    """On the CPU the FP8 GEMM does not run: the experts stay dense whatever is asked."""
    model = load_model(fp8_checkpoint, torch.bfloat16, "cpu", keep_fp8=True, fp8_only=True)
    assert all(m.has_dense for m in model.modules() if isinstance(m, RoutedExperts))
