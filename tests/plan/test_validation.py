"""The performance model against recorded runs (dsmesh/plan/validate.py holds the rows:
the recorded figure, where it was recorded, and the band the prediction must fall in).

The bands are the targets the model was built to: one H200 +-15%, EP 2 on 2 H200s +-20%, the
seed's deployment +-25%; docs/PLAN.md records every row's ratio and each known miss.
"""

from __future__ import annotations

import pytest

from dsmesh.plan import validate
from dsmesh.plan.validate import ROWS, seed_gains


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_prediction_within_its_band(row: validate.Row) -> None:
    predicted, ratio, ok = row.check()
    assert ok, (
        f"{row.name}: predicted {predicted:,.1f} {row.unit} against {row.recorded:,.1f} "
        f"recorded ({ratio:.2f}, band {row.low}-{row.high})"
    )


def test_bands_are_the_stated_tolerances() -> None:
    """No band wider than its class's tolerance: a miss would show here, not be absorbed."""
    widths = {"1 H200": 0.15, "EP 2": 0.20, "H100": 0.25, "H800": 0.25}
    for row in ROWS:
        (tol,) = [t for key, t in widths.items() if key in row.name]
        assert row.low >= 1 - tol - 1e-9 and row.high <= 1 + tol + 1e-9, row.name


def test_seed_speedups_have_the_seeds_sign_and_order() -> None:
    """TBO in SGLang's order (the seed's engine): prefill gains most, at every prompt length,
    then decode at 256 sequences per GPU; at 32 it loses (the seed: +27-35%, +25%, -27%).
    EPLB: both phases gain, decode more (1.49x, 2.54x)."""
    g = seed_gains()
    prefill = [g[f"TBO, prefill, {n}K prompts"] for n in (1, 2, 4)]
    decode = g["TBO, decode at 256/GPU"]
    assert prefill[0] > prefill[1] > prefill[2] > decode > 0 > g["TBO, decode at 32/GPU"]
    assert g["EPLB, decode"] > g["EPLB, prefill"] > 1.0


def test_tbo_gains_near_the_seeds_size() -> None:
    """The schedule (dsmesh/plan/overlap.py) puts SGLang's prefill at +28-37% against the
    seed's +27-35% and decode at 256 per GPU at +26% against +25%."""
    g = seed_gains()
    for n in (1, 2, 4):
        assert 0.25 < g[f"TBO, prefill, {n}K prompts"] < 0.40
    assert 0.20 < g["TBO, decode at 256/GPU"] < 0.30


def test_tbo_loss_at_32_per_gpu_is_a_recorded_miss_in_size() -> None:
    """At 32 sequences per GPU the model loses 10% where the seed lost 27%: SGLang's
    five-stage pipeline hides the small transfers, and what is left is the second reading of
    the weights and each micro-batch's own kernels (docs/PLAN.md records the miss)."""
    assert -0.15 < seed_gains()["TBO, decode at 32/GPU"] < -0.05


def test_tbo_in_dsmeshs_order_has_the_seeds_sign_and_order() -> None:
    """dsmesh's own order (dsmesh/engine/model/deepseek.py) hides less, its combine(1) only
    behind shared experts: the seed's order holds there, the loss at 32 per GPU included."""
    g = seed_gains("dsmesh")
    prefill = [g[f"TBO, prefill, {n}K prompts"] for n in (1, 2, 4)]
    decode = g["TBO, decode at 256/GPU"]
    assert prefill[0] > prefill[1] > prefill[2] > decode > 0 > g["TBO, decode at 32/GPU"]


@pytest.mark.parametrize("skew", [0.3, 0.5, 1.0])
def test_eplb_order_holds_for_any_skew(skew: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order does not come from the default skew (chosen near the seed's sizes)."""
    from dsmesh.plan import balance

    real = balance.synthetic_balancedness
    monkeypatch.setattr(
        validate,
        "synthetic_balancedness",
        lambda e, ep, r, eplb: real(e, ep, r, eplb, skew=skew),
    )
    assert validate.eplb_speedup("decode") > validate.eplb_speedup("prefill") > 1.0


def test_the_table_prints_every_row() -> None:
    table = validate.validation_table()
    for row in ROWS:
        assert row.name in table
    assert "EPLB, decode" in table and "**miss**" not in table
