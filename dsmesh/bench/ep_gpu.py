"""Expert parallelism on GPUs over NCCL: correctness against EP 1, and per-GPU throughput.

  python -m dsmesh.bench.ep_gpu check --ep-size 2          # greedy tokens, EP N vs EP 1, on CUDA
  python -m dsmesh.bench.ep_gpu bench --ep-size 2 --layers 3 --out ep.json [--graphs]

``check`` runs the tiny V3 and V2-Lite checkpoints in float32 on CUDA: EP N over NCCL with
R = 0 and R = N, TBO off and on (four combinations over the two checkpoints), against
the single-GPU engine (which the CPU tests tie to transformers). ``bench`` builds
random-weight DeepSeek-V3 layers (hidden 7168, 256 experts top-8, MLA 128 heads, bf16) with
each rank holding its experts only, and times one prefill
step of 2000-token prompts and decode steps of ``--decode-batch`` sequences at 2000-token
contexts per GPU, TBO off and on; ``--ep-size 1`` is the single-GPU baseline. With
``--graphs`` the decode steps replay CUDA graphs, agreed across the group as under serving
(the all-to-all in its static mode inside the graphs; with TBO both micro-batches
captured). Figures are per GPU and per layer, next to the seed's (6.5k input / 2.8k output
tokens/s per H100 for 61-layer V3, i.e. 397k / 171k layer-tokens/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

SEED_LAYER_TOKENS = {"prefill": 6500 * 61, "decode": 2800 * 61}


# ---- check ------------------------------------------------------------------------------------


def run_check(ep_size: int, device: str) -> dict:
    from dsmesh.engine.ep.generate import generate_ep
    from dsmesh.engine.ep.runtime import EPConfig
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.model.tiny_model import make_tiny_model
    from dsmesh.engine.sampling.params import SamplingParams

    root = os.environ.get("TMPDIR", "/tmp")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 77, 130)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out: dict = {"ep_size": ep_size, "cases": []}
    for arch in ("v3", "v2-lite"):
        path = make_tiny_model(f"{root}/ep_gpu_{arch}", arch=arch)
        config = EngineConfig(model=str(path), device=device, dtype="float32")
        ref = [r.output_ids for r in LLMEngine(config).generate(prompts, params)]
        cases = [(0, False), (ep_size, True)] if arch == "v3" else [(0, True), (ep_size, False)]
        for redundant, tbo in cases:
            ep = EPConfig(ep_size=ep_size, num_redundant_experts=redundant)
            got = generate_ep(dataclasses.replace(config, tbo=tbo), ep, prompts, params)
            same = [r.output_ids for r in got] == ref
            out["cases"].append(
                {"arch": arch, "redundant": redundant, "tbo": tbo, "same_as_ep1": same}
            )
            print(f"check {arch} EP{ep_size} R={redundant} tbo={tbo}: same={same}", flush=True)
    out["all_same"] = all(c["same_as_ep1"] for c in out["cases"])
    return out


# ---- bench ------------------------------------------------------------------------------------


def _rank_bench(rank: int, args: argparse.Namespace, port: int, results) -> None:
    from dsmesh.bench.gpu import bench_decode, bench_prefill, init_random_, v3_layers_config
    from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
    from dsmesh.engine.ep.placement import round_robin_placement
    from dsmesh.engine.ep.runtime import EPConfig, init_group
    from dsmesh.engine.kv.pool import pages_for
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.model.build import build_model
    from dsmesh.engine.model.config import ModelConfig
    from dsmesh.engine.model.expert_location import ExpertLocation

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    n = args.ep_size
    if n > 1:
        init_group(EPConfig(ep_size=n, master_port=port), rank, device)
    cfg = ModelConfig.from_dict(v3_layers_config(args.layers, tiny=args.tiny))
    num_moe = len(cfg.moe_layer_ids)
    if n > 1:
        placement = round_robin_placement(num_moe, cfg.moe.n_routed_experts, n, args.redundant)
        dispatcher = AllToAllDispatcher(placement.num_local_physical)
    else:
        placement, dispatcher = ExpertLocation.trivial(num_moe, cfg.moe.n_routed_experts), None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, dtype, device, placement, dispatcher, rank)
    init_random_(model, seed=0)
    expert_gb = (
        sum(
            p.numel() * p.element_size()
            for name, p in model.named_parameters()
            if "experts" in name
        )
        / 1e9
    )
    page = 64
    per_decode = pages_for(args.context + 64, page) * page
    engine_cfg = EngineConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        page_size=page,
        max_total_tokens=max(args.decode_batch * per_decode, args.prefill_prompts * 2048 + page),
        max_running_requests=max(args.decode_batch, args.prefill_prompts),
        max_batch_tokens=args.prefill_prompts * args.prompt_len,
        cuda_graphs=args.graphs,
        cuda_graph_max_batch=args.decode_batch,
    )
    engine = LLMEngine(engine_cfg, model=model)
    if args.graphs:
        _decode_graphs(engine, args.decode_batch, n)
    gen = torch.Generator(device=device).manual_seed(1)
    engine.kv_pool.buffer.normal_(0.0, 1.0, generator=gen)
    row: dict = {"rank": rank, "expert_weights_gb": round(expert_gb, 2), "graphs": args.graphs}
    for tbo in (False, True):
        engine.config = dataclasses.replace(engine_cfg, tbo=tbo)
        if args.graphs:  # the runner captures both micro-batches; kernels chosen again for it
            engine.graph_runner.tbo = tbo
            engine.switch_kernels()
        key = "tbo" if tbo else "no_tbo"
        t = bench_prefill(engine, cfg.vocab_size, args.prompt_len, args.prefill_prompts, 3)
        row[f"prefill_{key}_step_s"] = t
        t = bench_decode(
            engine, cfg.vocab_size, args.decode_batch, args.context, args.steps, 3, args.graphs
        )
        row[f"decode_{key}_step_s"] = t
    if args.graphs:  # decode forwards the runner ran (replays on CUDA): the path was taken
        runner = engine.graph_runner
        row["runner_replays"], row["runner_eager"] = runner.num_replays, runner.num_eager
    results[rank] = row


def _decode_graphs(engine, max_batch: int, ep_size: int) -> None:
    """Decode steps through the graph runner, agreed across the group as under serving
    (``LLMEngine.join_group``): captured on CUDA, the static all-to-all inside the graphs;
    on CPU (``--tiny``) the same static path uncaptured."""
    from dsmesh.bench.gpu import add_cpu_graph_runner
    from dsmesh.engine.ep.runtime import GroupVote

    add_cpu_graph_runner(engine, max_batch)
    if engine.graph_runner is None:
        raise RuntimeError("--graphs: the engine built no graph runner (see its log)")
    if ep_size > 1:
        engine.join_group(GroupVote(num_flags=3))


def run_bench(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    from dsmesh.engine.ep.runtime import free_port

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _rank_bench,
            args=(args, free_port(), results),
            nprocs=args.ep_size,
            start_method="spawn",
        )
        rows = [results[r] for r in range(args.ep_size)]
    summary: dict = {
        "ep_size": args.ep_size,
        "layers": args.layers,
        "redundant": args.redundant,
        "prompt_len": args.prompt_len,
        "prefill_prompts_per_gpu": args.prefill_prompts,
        "decode_batch_per_gpu": args.decode_batch,
        "context": args.context,
        "graphs": args.graphs,
        "ranks": rows,
    }
    for key in ("no_tbo", "tbo"):
        t_pre = max(r[f"prefill_{key}_step_s"] for r in rows)  # the group's step is its slowest
        t_dec = max(r[f"decode_{key}_step_s"] for r in rows)
        pre = args.prefill_prompts * args.prompt_len / t_pre
        dec = args.decode_batch / t_dec
        summary[key] = {
            "prefill_tokens_per_s_per_gpu": round(pre),
            "decode_tokens_per_s_per_gpu": round(dec),
            "prefill_layer_tokens_per_s": round(pre * args.layers),
            "decode_layer_tokens_per_s": round(dec * args.layers),
            "prefill_vs_seed": round(pre * args.layers / SEED_LAYER_TOKENS["prefill"], 3),
            "decode_vs_seed": round(dec * args.layers / SEED_LAYER_TOKENS["decode"], 3),
            "decode_step_ms": round(t_dec * 1e3, 2),
            "prefill_step_ms": round(t_pre * 1e3, 1),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("check", "bench"))
    p.add_argument("--ep-size", type=int, default=torch.cuda.device_count() or 1)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--redundant", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--prefill-prompts", type=int, default=4)
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument(
        "--graphs", action="store_true", help="decode through CUDA graphs (static all-to-all)"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print(
            "dsmesh.bench.ep_gpu needs CUDA GPUs (or --tiny for a CPU smoke run)", file=sys.stderr
        )
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    start = time.time()
    if args.what == "check":
        result = run_check(args.ep_size, "cuda" if torch.cuda.is_available() else "cpu")
    else:
        result = run_bench(args)
    result.update(
        date=time.strftime("%Y-%m-%d"),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        num_gpus=torch.cuda.device_count(),
        torch=torch.__version__,
        seconds=round(time.time() - start, 1),
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if result.get("all_same", True) else 1


if __name__ == "__main__":
    sys.exit(main())
