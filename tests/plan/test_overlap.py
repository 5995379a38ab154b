"""Two-batch overlap as a schedule (dsmesh/plan/overlap.py): what hides follows from the
order of the operations, worked by hand for one layer."""

from __future__ import annotations

import pytest

from dsmesh.plan.overlap import LayerPieces, overlapped_ms


def test_no_communication_costs_the_compute_of_both_halves() -> None:
    p = LayerPieces(prep=1.0, core=2.0, shared=0.5, routed=3.0, dispatch=0.0, combine=0.0)
    for schedule, phase in (("sglang", "prefill"), ("sglang", "decode"), ("dsmesh", "decode")):
        assert overlapped_ms(p, 10, schedule, phase) == pytest.approx(10 * 2 * 6.5)


def test_sglang_prefill_hides_transfers_shorter_than_the_other_halfs_compute() -> None:
    """dispatch(A) runs behind B's attention, dispatch(B) behind A's experts, combine(A)
    behind B's experts: with each transfer shorter than that compute the layer costs the
    compute alone, after the first layer's fill."""
    p = LayerPieces(prep=1.0, core=4.0, shared=1.0, routed=6.0, dispatch=2.0, combine=4.0)
    one = 2 * (1.0 + 4.0 + 1.0 + 6.0)
    twenty, ten = (overlapped_ms(p, n, "sglang", "prefill") for n in (20, 10))
    assert twenty - ten == pytest.approx(10 * one)


def test_a_transfer_longer_than_the_compute_behind_it_shows() -> None:
    """Decode, dsmesh's order, one layer by hand: attention(0) and (1) end at 0.6 ms,
    experts(0) at 0.8, when combine(0) is sent; combine(1) queues behind it on the network,
    so the layer ends when both have arrived, 0.8 + 2 x 0.5 = 1.8 ms, not the 1.2 ms of
    compute: only the second half's experts and the shared experts ran behind them."""
    p = LayerPieces(prep=0.1, core=0.2, shared=0.1, routed=0.2, dispatch=0.1, combine=0.5)
    assert overlapped_ms(p, 1, "dsmesh", "decode") == pytest.approx(1.8)
    twenty, nineteen = (overlapped_ms(p, n, "dsmesh", "decode") for n in (20, 19))
    assert twenty - nineteen == pytest.approx(1.8)


def test_transfers_holding_sms_slow_the_compute_beside_them() -> None:
    """Normal kernels hold their SMs: a layer with a fifth of the SMs taken while 2 ms of
    transfers run costs more than the compute alone, and less than compute + transfers."""
    free = LayerPieces(1.0, 4.0, 1.0, 6.0, 1.0, 1.0, comm_sms=0.0)
    held = LayerPieces(1.0, 4.0, 1.0, 6.0, 1.0, 1.0, comm_sms=0.2)
    a = overlapped_ms(free, 10, "sglang", "prefill")
    b = overlapped_ms(held, 10, "sglang", "prefill")
    assert a < b < a + 10 * 2 * 2.0


def test_unknown_schedule_is_refused() -> None:
    p = LayerPieces(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="schedule"):
        overlapped_ms(p, 4, "vllm", "decode")
