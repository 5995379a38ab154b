"""Expert-parallel step time on CPU (gloo) against the EP size, and all-to-all bytes per step.

    python -m dsmesh.bench.ep_step [--sizes 1,2,4] [--requests-per-rank 8] [--steps 30]

Each rank decodes ``--requests-per-rank`` requests (DP attention) on the tiny default model;
the median decode step time and the MoE all-to-all payload each rank sends per step are
reported. CPU figures show the mechanics, not GPU speed (dsmesh.bench.ep_gpu measures GPUs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from dsmesh.engine.ep.runtime import EPConfig, build_ep_engine, free_port, init_group
from dsmesh.engine.llm_engine import EngineConfig
from dsmesh.engine.sampling.params import SamplingParams


def _rank(rank: int, ep_size: int, port: int, per_rank: int, steps: int, tbo: bool, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    ep = EPConfig(ep_size, 0, master_port=port)
    init_group(ep, rank, torch.device("cpu"))
    try:
        engine = build_ep_engine(EngineConfig(page_size=16, tbo=tbo), ep, rank)
        g = torch.Generator().manual_seed(rank)
        params = SamplingParams(max_new_tokens=steps + 5, ignore_eos=True)
        for _ in range(per_rank):
            engine.add_request(torch.randint(3, 500, (64,), generator=g).tolist(), params)
        engine.step()  # prefill
        dispatcher = engine.model.moe_layers()[0].dispatcher
        sent0 = getattr(dispatcher, "bytes_sent", 0)
        times = []
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            engine.step(idle_forward=True)
            times.append(time.perf_counter() - t)
        sent = getattr(dispatcher, "bytes_sent", 0) - sent0
        out[rank] = (statistics.median(times), sent / steps)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--requests-per-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tbo", action="store_true")
    args = ap.parse_args()
    print(
        f"decode step, {args.requests_per_rank} requests per rank, tiny model, gloo, "
        f"1 thread per rank, tbo={args.tbo}"
    )
    print(f"{'EP':>3} {'step ms (median over ranks)':>28} {'a2a KiB sent/rank/step':>24}")
    for n in (int(x) for x in args.sizes.split(",")):
        with mp.get_context("spawn").Manager() as manager:
            out = manager.dict()
            mp.start_processes(
                _rank,
                args=(n, free_port(), args.requests_per_rank, args.steps, args.tbo, out),
                nprocs=n,
                start_method="spawn",
            )
            res = dict(out)
        step = statistics.median(v[0] for v in res.values()) * 1e3
        sent = statistics.mean(v[1] for v in res.values()) / 1024
        print(f"{n:>3} {step:>28.2f} {sent:>24.1f}")


if __name__ == "__main__":
    main()
