"""Decode through the expert-parallel code path under CUDA graphs, on one GPU (EP size 1).

The same V2-Lite-shaped engine decodes four ways, in one process, back to back:

- ``graphs``: the single-rank path (LocalDispatcher, fused decode MoE) captured;
- ``eager``: the same path uncaptured (the eager forward with the fused glue kernels);
- ``ep_graphs``: every MoE layer behind the all-to-all dispatcher of a one-rank
  torch.distributed group (NCCL on CUDA) in its static mode, captured, every step agreed
  through the group vote as under real expert parallelism;
- ``ep_eager``: the same dispatcher in its dynamic (host-sized) mode, uncaptured;
- ``ep_tbo_graphs``: ``ep_graphs`` with two-batch overlap (both micro-batches captured,
  their all-to-alls on the dispatcher's communication stream);
- ``ep_tbo_eager``: ``ep_eager`` with two-batch overlap;
- ``ep_local_graphs`` (diagnostic): ``ep_graphs`` with each all-to-all replaced by a device
  copy of the send buffer into the receive buffer (what a one-rank exchange moves), which
  splits the EP path's cost into the collectives' and the dispatcher's own work.

``--profile`` prints CUDA kernel tables of one uncaptured forward and of one graph replay
at the largest batch, for the plain and the EP path.

Prints one JSON line: per batch, mean step milliseconds of each, the steps of each block
launched ahead, and ``ep_graphs`` over ``graphs``. Usage: ``python3 -m dsmesh.bench.ep_graphs
--batches 32,256 --context 2000``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from dsmesh.bench.gpu import bench_decode, build_dsmesh, make_engine, v2_lite_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test")
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--context", type=int, default=2000)
    # 50: with 10, one slow step moves a block's mean by milliseconds
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per block")
    ap.add_argument("--profile", action="store_true", help="kernel tables at the largest batch")
    return ap.parse_args(argv)


def kernel_table(engine, batch: int, rows: int = 25) -> str:
    """CUDA kernel times of one uncaptured forward of the runner at ``batch``'s bucket."""
    runner = engine.graph_runner
    keys = [k for k in runner.keys_used if k[0] >= batch]
    if not keys or engine.device.type != "cuda":
        return ""
    return _profiled(lambda: runner.forward(*min(keys)), rows)


def replay_table(engine, batch: int, rows: int = 25) -> str:
    """CUDA kernel times inside one replay of the graph captured for ``batch``'s bucket."""
    runner = engine.graph_runner
    keys = [k for k in runner.graphs if k[0] >= batch]
    if not keys or engine.device.type != "cuda":
        return ""
    graph, _ = runner.graphs[min(keys)]
    return _profiled(graph.replay, rows)


def _profiled(run, rows: int) -> str:
    """``run()`` once to warm, then once under torch.profiler: its CUDA kernels' table."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def capture(engine, batches: list[int], context: int, steps: int) -> None:
    """Capture the graphs the decode blocks of ``batches`` replay (every page bucket their
    contexts cross: ``context`` tokens plus the warm-up and timed ``steps``), so no capture
    lands inside a timed block. With 50 steps at 2000 tokens the contexts cross 2048, and
    after the runner's graphs were dropped (a dispatcher switched) that capture used to be
    timed. Writes KV into the pool's first pages: call it with no request running."""
    runner = engine.graph_runner
    if runner is None or not runner.use_graphs:
        return
    pages = sorted({runner.inputs.page_bucket(t) for t in range(context, context + steps + 1)})
    for b in batches:
        for p in pages:
            runner.run([0] * b, [p * runner.page_size - 1] * b, [range(p)] * b)
    torch.cuda.synchronize(engine.device)


def local_exchange_dispatcher(num_local: int):
    """The all-to-all dispatcher whose static exchange is a device copy (what a one-rank
    all-to-all moves), for ``ep_local_graphs``: bench-only, never served."""
    from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
    from dsmesh.engine.model.moe_dispatch import Pending

    class LocalExchange(AllToAllDispatcher):
        def _exchange_static(self, out: torch.Tensor, src: torch.Tensor) -> Pending:
            out.copy_(src)
            return Pending(lambda: None)

    return LocalExchange(num_local)


def main(argv: list[str] | None = None) -> dict[str, object]:
    from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
    from dsmesh.engine.ep.runtime import GroupVote, free_port

    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", device.index or 0) if device.type == "cuda" else None,
    )
    model = build_dsmesh(v2_lite_config(args.tiny), device, dtype)
    vocab = model.config.vocab_size
    # steps + 16: a page to spare per request (join_group keeps one for idle graph steps)
    shape = types.SimpleNamespace(
        page_size=16, context=args.context, steps=args.steps + 16, prompt_len=16, prefill_prompts=1
    )
    engine = make_engine(model, device, max(batches), shape)
    rows: dict[int, dict[str, float]] = {b: {} for b in batches}

    def decode(name: str, graphs: bool) -> None:
        if graphs:  # 3 warm-up steps, the timed ones, one more
            capture(engine, batches, args.context, args.steps + 4)
        for b in batches:
            ahead = engine.num_launched_ahead
            step = bench_decode(engine, vocab, b, args.context, args.steps, 3, graphs)
            rows[b][f"{name}_ms"] = step * 1e3
            # steps launched before the previous one ended (overlapped decode; in a group,
            # agreed by the ranks' host vote): the host work hidden behind the GPU's
            rows[b][f"{name}_launched_ahead"] = engine.num_launched_ahead - ahead

    decode("graphs", True)
    tables = {}
    if args.profile:
        tables["graphs"] = kernel_table(engine, max(batches))
        tables["graphs replay"] = replay_table(engine, max(batches))
    decode("eager", False)
    dispatcher = AllToAllDispatcher(model.moe_layers()[0].experts.num_local)
    dispatcher.triton = model.kernels.triton  # as DeepseekMoE.set_kernels sets it
    for moe in model.moe_layers():
        moe.dispatcher = dispatcher
    if engine.graph_runner is not None:
        engine.graph_runner.reset()
    engine.join_group(GroupVote(num_flags=3))
    decode("ep_graphs", True)
    if args.profile:
        tables["ep_graphs"] = kernel_table(engine, max(batches))
        tables["ep_graphs replay"] = replay_table(engine, max(batches))
    decode("ep_eager", False)
    local = local_exchange_dispatcher(model.moe_layers()[0].experts.num_local)
    local.triton = model.kernels.triton
    for moe in model.moe_layers():
        moe.dispatcher = local
    if engine.graph_runner is not None:
        engine.graph_runner.reset()
        decode("ep_local_graphs", True)
        if args.profile:
            tables["ep_local_graphs replay"] = replay_table(engine, max(batches))
    for moe in model.moe_layers():
        moe.dispatcher = dispatcher
    # two-batch overlap; kernels chosen again for it (Triton decode attention)
    engine.config = dataclasses.replace(engine.config, tbo=True)
    if engine.graph_runner is not None:
        engine.graph_runner.tbo = True
        engine.switch_kernels()  # drops the graphs captured without TBO
        decode("ep_tbo_graphs", True)
    decode("ep_tbo_eager", False)
    for row in rows.values():
        row["ep_graphs_over_graphs"] = row["ep_graphs_ms"] / row["graphs_ms"]
        if "ep_local_graphs_ms" in row:
            row["ep_local_graphs_over_graphs"] = row["ep_local_graphs_ms"] / row["graphs_ms"]
        row["graphs_speedup_over_eager"] = row["eager_ms"] / row["graphs_ms"]
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "context": args.context,
        "kernels": str(model.kernels),
        "attention_backend": model.decode_backend.name,
        "batches": rows,
    }
    for name, table in tables.items():
        print(f"--- {name}, batch {max(batches)}\n{table}")
    print(json.dumps(out))
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
