"""DeepEP's normal-mode dispatcher against the torch all-to-all one, on 2 GPUs over NCCL.

Runs only where ``deep_ep`` is built and two GPUs are visible (a host of
several GPUs); elsewhere it is skipped with the reason. Both backends must honour the same
contract: ``combine(f(dispatch(x).hidden))[t] == sum_k w[t,k] * f_{ids[t,k]}(x[t])``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

needs = pytest.mark.skipif(
    importlib.util.find_spec("deep_ep") is None
    or not torch.cuda.is_available()
    or torch.cuda.device_count() < 2,
    reason="needs deep_ep built and 2 CUDA GPUs",
)

NUM_PHYSICAL, TOP_K, HIDDEN, TOKENS = 16, 4, 2048, 96


def _expert_fn(rows: torch.Tensor, tokens_per_expert: torch.Tensor, first: int) -> torch.Tensor:
    """Physical expert p multiplies by (p + 1): easy to predict, distinct per expert."""
    scale = torch.repeat_interleave(
        torch.arange(first, first + len(tokens_per_expert), device=rows.device) + 1.0,
        tokens_per_expert.to(rows.device),
    )
    return rows * scale[:, None].to(rows.dtype)


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
    from dsmesh.engine.ep.deepep import DeepEPNormalDispatcher
    from dsmesh.engine.ep.runtime import EPConfig, init_group

    device = torch.device("cuda", rank)
    init_group(EPConfig(ep_size=2, master_port=port), rank, device)
    try:
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(TOKENS, HIDDEN, device=device, generator=g).to(torch.bfloat16)
        scores = torch.rand(TOKENS, NUM_PHYSICAL, device=device, generator=g)
        ids = scores.topk(TOP_K, dim=-1).indices
        w = torch.rand(TOKENS, TOP_K, device=device, generator=g)
        local = NUM_PHYSICAL // 2
        want = (x.float()[:, None, :] * (ids + 1.0)[..., None] * w[..., None]).sum(1)
        out = {}
        for name, disp in (
            ("all_to_all", AllToAllDispatcher(local)),
            ("deepep_normal", DeepEPNormalDispatcher(local, NUM_PHYSICAL, HIDDEN)),
        ):
            d = disp.dispatch(x, ids, w)
            y = disp.combine(_expert_fn(d.hidden, d.tokens_per_expert, rank * local), d)
            out[name] = float((y.float() - want).abs().max() / want.abs().max())
        results[rank] = out
    finally:
        dist.destroy_process_group()


@needs
def test_deepep_normal_matches_the_contract_and_all_to_all() -> None:
    import torch.multiprocessing as mp

    from dsmesh.engine.ep.runtime import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
        errors = dict(results)
    print("relative errors", errors)
    for rank in (0, 1):
        assert errors[rank]["all_to_all"] < 2e-2
        assert errors[rank]["deepep_normal"] < 2e-2
