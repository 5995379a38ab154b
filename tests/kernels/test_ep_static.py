"""Static all-to-all buffers (dsmesh.kernels.ep_static): slots without sorting equal the stable sort
by destination rank; the Triton pack equals its torch reference, padding included, at EP
sizes 1, 2 and 4 (simulated: a rank's ``num_local`` below the physical expert count); the
gather-combine back gives each token its weighted expert sum."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.ep_static import id_columns, ids_of, pack_static, pack_static_ref
from dsmesh.kernels.moe_gemm import gather_combine, gather_combine_ref
from tests.kernels.conftest import needs_triton


def _routing(tokens: int, physical: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(physical, generator=g)[:k] for _ in range(tokens)])
    return ids, torch.rand(tokens, k, generator=g)


def _sorted_slots(ids: torch.Tensor, num_local: int, ep_size: int) -> torch.Tensor:
    """The slots as the dispatcher computed them before: stable argsort by destination rank,
    then each pair's rank among its destination's pairs; returned in flat pair order."""
    dest = ids.reshape(-1) // num_local
    cap = dest.numel()
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=ep_size)
    sorted_dest = dest[order]
    in_sorted = sorted_dest * cap + torch.arange(cap) - (counts.cumsum(0) - counts)[sorted_dest]
    return torch.empty_like(in_sorted).index_copy_(0, order, in_sorted)


CASES = [  # tokens, num_local, ep_size, k
    (1, 4, 1, 2),
    (9, 8, 1, 3),
    (7, 3, 2, 2),
    (13, 2, 4, 3),
    (5, 1, 4, 1),  # one expert per rank: most ranks get few pairs, much padding
]


@pytest.mark.parametrize(("tokens", "num_local", "ep_size", "k"), CASES)
def test_reference_slots_equal_the_stable_sort_and_pack_rows(tokens, num_local, ep_size, k):
    ids, _ = _routing(tokens, num_local * ep_size, k, seed=tokens)
    x = torch.randn(tokens, 6)
    send, slot = pack_static_ref(x, ids, num_local, ep_size)
    assert slot.tolist() == _sorted_slots(ids, num_local, ep_size).tolist()
    cap = tokens * k
    assert send.shape == (ep_size * cap, 6 + id_columns(x.dtype))
    carried = ids_of(send)
    flat = ids.reshape(-1)
    assert carried[slot].tolist() == (flat % num_local).tolist()
    padding = torch.ones(ep_size * cap, dtype=torch.bool)
    padding[slot] = False
    assert (carried[padding] == -1).all()
    assert int(padding.sum()) == ep_size * cap - cap
    torch.testing.assert_close(send[slot, :6], x[torch.arange(cap) // k], rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize(("tokens", "num_local", "ep_size", "k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_kernel_equals_reference(tokens, num_local, ep_size, k, dtype, device) -> None:
    ids, _ = _routing(tokens, num_local * ep_size, k, seed=tokens + 1)
    wide = torch.randn(tokens, 12).to(dtype)
    x = wide[:, :8]  # a row stride wider than the row
    got_send, got_slot = pack_static(wide.to(device)[:, :8], ids.to(device), num_local, ep_size)
    want_send, want_slot = pack_static_ref(x, ids, num_local, ep_size)
    got_send, got_slot = got_send.cpu(), got_slot.cpu()
    assert got_slot.tolist() == want_slot.tolist()
    assert ids_of(got_send).tolist() == ids_of(want_send).tolist()  # padding's -1 too
    assert torch.equal(got_send[want_slot, :8], want_send[want_slot, :8])


@needs_triton
def test_pack_kernel_with_no_tokens(device) -> None:
    send, slot = pack_static(
        torch.empty(0, 8, device=device), torch.empty(0, 2, dtype=torch.int64, device=device), 4, 2
    )
    assert send.shape == (0, 8 + id_columns(torch.float32)) and slot.shape == (0,)


def _expert_round_trip(combine, tokens, num_local, ep_size, k, dtype, device):
    """Pack, let local expert ``e`` multiply its rows by ``e + 1`` (the buffer stands for
    what comes back from every rank), combine: each token's weighted expert sum."""
    ids, w = _routing(tokens, num_local * ep_size, k, seed=3 * tokens)
    x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(tokens))
    send, slot = pack_static_ref(x.to(dtype), ids, num_local, ep_size)
    local = ids_of(send)
    back = send.clone()
    back[:, :8].mul_((local + 1).clamp(min=0).to(dtype)[:, None])
    back[local < 0, :8] = float("nan")  # padding rows are never read
    rows = back.to(device)[:, :8]  # read in place, through the row stride
    got = combine(rows, slot.to(device), w.to(device)).cpu()
    want = (x[:, None, :] * ((ids % num_local) + 1)[..., None] * w[..., None]).sum(1)
    return got, want.to(dtype)


@pytest.mark.parametrize(("tokens", "num_local", "ep_size", "k"), CASES)
def test_gather_combine_reference_is_the_weighted_expert_sum(tokens, num_local, ep_size, k):
    got, want = _expert_round_trip(
        gather_combine_ref, tokens, num_local, ep_size, k, torch.float32, "cpu"
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize(("tokens", "num_local", "ep_size", "k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_combine_kernel_equals_reference(tokens, num_local, ep_size, k, dtype, device):
    got, want = _expert_round_trip(gather_combine, tokens, num_local, ep_size, k, dtype, device)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    ref, _ = _expert_round_trip(gather_combine_ref, tokens, num_local, ep_size, k, dtype, "cpu")
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
