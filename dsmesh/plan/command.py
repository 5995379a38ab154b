"""``dsmesh plan``: the flags of dsmesh/cli/plan.py into a search, and its report."""

from __future__ import annotations

import argparse
import math
from functools import lru_cache

from dsmesh.plan.balance import placement_balancedness, trace_load
from dsmesh.plan.hardware import GPUS, spec_gpu
from dsmesh.plan.report import k8s_overlay, plans_table, plot, up_command, write_overlay
from dsmesh.plan.search import Target, search, synthetic_balance
from dsmesh.plan.shapes import PRESETS, resolve_shape

# where a preset's checkpoint lives in the commands and overlays printed (--model-path)
PRESET_PATHS = {
    "v3": "/models/DeepSeek-V3",
    "r1": "/models/DeepSeek-R1",
    "v2": "/models/DeepSeek-V2",
    "v2-lite": "/models/DeepSeek-V2-Lite",
}


def run_plan(args: argparse.Namespace) -> int:
    if args.validate:
        from dsmesh.plan.validate import validation_table

        print(validation_table())
        return 0
    if args.questions:
        from dsmesh.plan.questions import questions_report

        print(questions_report())
        return 0
    shape = resolve_shape(args.model)
    model_path = args.model_path or (
        PRESET_PATHS[args.model.lower()] if args.model.lower() in PRESETS else args.model
    )
    if args.gpu == "spec":
        if not args.gpu_spec:
            raise ValueError("--gpu spec needs --gpu-spec")
        gpu = spec_gpu(args.gpu_spec)
    else:
        if args.gpu_spec:
            raise ValueError("--gpu-spec goes with --gpu spec")
        gpu = GPUS[args.gpu]
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1 (got {args.gpus})")
    if not 0.0 <= args.mtp_acceptance < 1.0:
        raise ValueError(f"--mtp-acceptance must be in [0, 1) (got {args.mtp_acceptance})")
    if args.top < 1 or args.max_batch < 1:
        raise ValueError("--top and --max-batch must be at least 1")
    balance = synthetic_balance
    if args.eplb_load:
        if not args.eplb_load.is_file():
            raise ValueError(f"--eplb-load: no such file {args.eplb_load}")
        load = trace_load(args.eplb_load)
        if len(load[0]) != shape.num_experts:
            raise ValueError(
                f"--eplb-load: {len(load[0])} experts in the file, the model has "
                f"{shape.num_experts}"
            )

        @lru_cache(maxsize=1024)
        def balance(experts: int, ep: int, redundant: int) -> float:
            return placement_balancedness(load, ep, redundant, eplb=True)

    target = Target(
        input_len=sum(args.input_len) / 2,
        output_len=sum(args.output_len) / 2,
        ttft_p90_ms=args.ttft_p90,
        itl_p90_ms=args.itl_p90,
        mtp_acceptance=args.mtp_acceptance,
        fixed_output=args.output_len[0] == args.output_len[1],
    )
    modes = ("pd", "unified") if args.mode == "both" else (args.mode,)
    concurrency = getattr(args, "concurrency", None)
    if concurrency:
        from dsmesh.plan.closed_loop import search_concurrency

        plans = search_concurrency(
            shape, gpu, args.gpus, target, concurrency, modes, args.max_batch, balance
        )
        load = f"a closed loop of {concurrency} clients"
    else:
        plans = search(shape, gpu, args.gpus, target, modes, args.max_batch, balance)
        load = "the most requests/s the targets allow"
    print(
        f"dsmesh plan: {shape.name} on {args.gpus} x {gpu.describe()}\n"
        f"workload: input {target.input_len:g}, output {target.output_len:g} tokens, {load}; "
        f"targets TTFT p90 {target.ttft_p90_ms:g} ms, ITL p90 {target.itl_p90_ms:g} ms; "
        f"{len(plans)} plans meet them"
    )
    if not plans:
        print("no deployment meets the targets: relax --ttft-p90 / --itl-p90 or add GPUs")
        return 1
    print()
    print(plans_table(plans[: args.top]))
    if args.rate:
        for i, p in enumerate(plans[: args.top], 1):
            copies = math.ceil(args.rate / p.rate)
            print(f"#{i}: {copies} x {p.gpus} GPUs serve {args.rate:g} req/s")
    print()
    best = plans[0]
    node = gpu.gpus_per_host
    print(
        f"the best per {node}-GPU host: {best.out_tok_s_gpu * node:,.0f} output and "
        f"{best.in_tok_s_gpu * node:,.0f} input tok/s"
    )
    command = up_command(best, model_path, gpu)
    if command:
        print(f"run the best: {command}")
    else:
        print(
            f"the best ({best.layout()}) needs more than one host or different EP sizes per "
            "role: deploy it with a Kubernetes overlay (--k8s-overlay DIR)"
        )
    if args.k8s_overlay:
        pd = next((p for p in plans if p.mode == "pd"), None)
        if pd is None:
            raise ValueError("--k8s-overlay: no PD plan meets the targets")
        write_overlay(k8s_overlay(pd, model_path, gpu), args.k8s_overlay)
        print(f"wrote a kustomize overlay for {pd.layout()} to {args.k8s_overlay}")
    if args.plot:
        plot(plans, args.plot, f"{shape.name}, {args.gpus} x {gpu.name}")
        print(f"wrote {args.plot}")
    return 0
