"""dsmesh.bench.mtp on CPU (--tiny): the speculative and plain engines both decode, the
``--routing shared`` diagnostic really sends every token of the target and the draft to the
same experts (so a verify step reads no more experts than a plain one), and ``pinned:N``
shares exactly N of them."""

from __future__ import annotations

import pytest
import torch

from dsmesh.bench import mtp
from dsmesh.bench.gpu import init_random_, v3_layers_config
from dsmesh.engine.model.build import build_model
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.mtp import build_mtp

pytestmark = pytest.mark.timeout(300)


def _tiny() -> tuple[torch.nn.Module, torch.nn.Module]:
    raw = v3_layers_config(2, tiny=True)
    raw["num_nextn_predict_layers"] = 1
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32, "cpu")
    init_random_(model, seed=0)
    draft = build_mtp(cfg, torch.float32, "cpu")
    mtp.init_draft_(draft, seed=1)
    return model, draft


def _expert_sets(module: torch.nn.Module, x: torch.Tensor) -> list[set[frozenset[int]]]:
    """Per MoE layer, the distinct sets of experts the rows of ``x`` route to."""
    out = []
    for moe in module.moe_layers():
        _, ids = moe.route(x)
        out.append({frozenset(row.tolist()) for row in ids})
    return out


def test_shared_routing_sends_every_token_to_the_same_k_experts() -> None:
    model, draft = _tiny()
    x = torch.randn(64, model.config.hidden_size)
    k = model.config.moe.num_experts_per_tok
    # random weights: 64 random rows route to many different sets
    assert all(len(sets) > 8 for sets in _expert_sets(model, x))
    assert mtp.share_routing_(model) == 2 and mtp.share_routing_(draft) == 1
    for module in (model, draft):
        for sets in _expert_sets(module, x):
            assert len(sets) == 1
            (chosen,) = sets
            assert len(chosen) == k


def test_pinned_routing_shares_n_experts_and_leaves_the_rest_to_the_router() -> None:
    model, draft = _tiny()
    x = torch.randn(64, model.config.hidden_size)
    k = model.config.moe.num_experts_per_tok
    pinned = k - 1
    mtp.pin_routing_(model, pinned, keep_router=True)
    mtp.pin_routing_(draft, pinned, keep_router=True)
    for module in (model, draft):
        for sets in _expert_sets(module, x):
            common = frozenset.intersection(*sets)
            assert len(common) == pinned  # every row keeps the pinned experts ...
            assert all(len(s) == k for s in sets)
            assert len(set().union(*sets) - common) > 1  # ... and the router varies the rest
    with pytest.raises(ValueError, match="pinned"):
        mtp.pin_routing_(model, k + 1, keep_router=True)


def test_routing_option_is_checked() -> None:
    assert mtp.parse_args(["--routing", "pinned:4"]).routing == "pinned:4"
    for bad in ("pinned", "pinned:0", "pinned:x", "same"):
        with pytest.raises(SystemExit):
            mtp.parse_args(["--routing", bad])


def test_bench_runs_both_engines_with_shared_routing() -> None:
    out = mtp.main(
        ["--tiny", "--device", "cpu", "--batches", "1,2", "--acceptance", "0.8"]
        + ["--steps", "4", "--warmup", "1", "--routing", "shared"]
    )
    assert out["routing"] == "shared" and out["experts"] == "float32"
    for row in out["runs"]:
        assert row["plain_tok_s"] > 0 and row["mtp_acc0.8_tok_s"] > 0
        # K = 1: a step emits the target's token plus the draft when it is accepted
        assert 1.0 <= row["mtp_acc0.8_tokens_per_step"] <= 2.0


def test_fp8_needs_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU-only refusal (on GPUs --fp8 runs)")
    with pytest.raises(SystemExit, match="--fp8"):
        mtp.main(["--tiny", "--device", "cpu", "--batches", "1", "--fp8", "--steps", "1"])
