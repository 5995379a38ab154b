"""Expert parallelism on CPU with gloo: two ranks, experts split (with redundant replicas)
and moved by all-to-all, each rank running its own requests (DP attention). Logits equal
the single-rank model's; an idle rank still joins every collective."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.tiny_model import make_tiny_model
from tests.mesh import free_port

pytestmark = pytest.mark.timeout(180)
PAGE = 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 33, 1, 70)]


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers, 256, PAGE, cfg.mla.kv_cache_dim, torch.float32)
    if not prompts:
        batch = ForwardBatch.empty("cpu")
    else:
        chunks = []
        for p in prompts:
            pages = torch.tensor(pool.allocator.allocate(-(-len(p) // PAGE)))
            chunks.append(SequenceChunk(p, 0, pages))
        batch = ForwardBatch.build(chunks, PAGE, "cpu")
    return model(batch, pool, all_logits=True)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    split: list[list[int]],
    redundant: int,
    results,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        reference = load_model(model_dir)
        cfg = reference.config
        placement = round_robin_placement(
            len(cfg.moe_layer_ids), cfg.moe.n_routed_experts, world, redundant
        )
        model = load_model(
            model_dir,
            expert_location=placement,
            dispatcher=AllToAllDispatcher(placement.num_local_physical),
            ep_rank=rank,
        )
        mine = [_prompts()[i] for i in split[rank]]
        got = _logits(model, mine)
        want = _logits(reference, mine) if mine else torch.empty(0, cfg.vocab_size)
        # each rank holds only its own experts' weights
        experts = model.moe_layers()[0].experts
        results[rank] = (
            got.shape[0],
            float((got - want).abs().max()) if mine else 0.0,
            float(want.abs().max()) if mine else 1.0,
            experts.w13.shape[0],
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3")


@pytest.mark.parametrize(
    ("split", "redundant"),
    [([[0, 1], [2, 3]], 0), ([[0, 1, 2, 3], []], 2), ([[3], [0, 1, 2]], 4)],
)
def test_ep2_logits_equal_single_rank(model_dir: Path, split, redundant: int) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    mp.start_processes(
        _rank_main,
        args=(2, free_port(), str(model_dir), split, redundant, results),
        nprocs=2,
        start_method="spawn",
    )
    expected_local = (16 + redundant) // 2
    for rank in (0, 1):
        rows, err, scale, local = results[rank]
        assert rows == sum(len(_prompts()[i]) for i in split[rank])
        assert err <= 1e-5 * scale, (rank, err, scale)
        assert local == expected_local


def test_dispatch_backend_choice_is_explicit() -> None:
    """Forced DeepEP without deep_ep is refused up front; "auto" falls back to all-to-all
    (on CPU, whatever is installed) and says why."""
    from dsmesh.engine.ep.deepep import deepep_available
    from dsmesh.engine.ep.runtime import EPConfig, check_dispatch

    check_dispatch(EPConfig(ep_size=2, dispatch="auto"))  # never refuses
    usable, why = deepep_available(torch.device("cpu"))
    assert not usable and why
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="deep_ep is not installed"):
            check_dispatch(EPConfig(ep_size=2, dispatch="deepep"))
    with pytest.raises(ValueError, match="moe_dispatch"):
        EPConfig(ep_size=2, dispatch="nccl").validate()
    with pytest.raises(ValueError, match="ep_nnodes"):
        EPConfig(ep_size=4, nnodes=3).validate()
    with pytest.raises(ValueError, match="ep_master_port"):
        EPConfig(ep_size=4, nnodes=2).validate()
