"""``dsmesh plan``: search deployments with the performance model (docs/PLAN.md).

Registering the command imports nothing of the model: ``run`` imports dsmesh.plan when the
command runs, so ``dsmesh --help`` stays light.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsmesh.options.parse import int_range

GPU_NAMES = ("h100", "h200", "gb200", "h800", "spec")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


EXAMPLES = """examples:
  dsmesh plan --gpus 96 --input-len 2000 --output-len 1000 --ttft-p90 5000 --itl-p90 100
  dsmesh plan --model v2-lite --gpu h200 --gpus 1 --input-len 1000 --output-len 128 \\
      --concurrency 64 --ttft-p90 2000 --itl-p90 50
  dsmesh plan --validate
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Search deployments of --gpus GPUs (unified or PD, prefill:decode split, "
        "EP sizes, redundant experts, chunk and batch sizes, TBO, MTP) with the performance "
        "model of docs/PLAN.md; print the best few with their throughput per GPU, latency "
        "percentiles and binding constraint, and the dsmesh up command (or Kubernetes "
        "overlay) that runs the best. Runs on the CPU in seconds; nothing is measured."
    )
    p.add_argument(
        "--model",
        default="v3",
        help="preset (v3, r1, v2, v2-lite), checkpoint folder or config.json (default v3)",
    )
    p.add_argument("--gpu", choices=GPU_NAMES, default="h100", help="GPU type (default h100)")
    p.add_argument(
        "--gpu-spec", metavar="HBM,BF16,FP8,GIB,NVLINK,RDMA,PER_NODE",
        help="with --gpu spec: HBM TB/s, bf16 and FP8 TFLOP/s, memory GiB, NVLink and RDMA GB/s "
        "per GPU, GPUs per NVLink domain (the H200's kernel efficiencies apply)",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, default=8, metavar="N", help="GPUs to deploy on (default 8)")
    p.add_argument(
        "--input-len",
        type=int_range,
        default=(2000, 2000),
        metavar="N|MIN,MAX",
        help="prompt tokens (default 2000)",
    )
    p.add_argument(
        "--output-len",
        type=int_range,
        default=(1000, 1000),
        metavar="N|MIN,MAX",
        help="output tokens (default 1000)",
    )
    p.add_argument(
        "--ttft-p90",
        type=_positive,
        default=5000.0,
        metavar="MS",
        help="TTFT p90 target, ms (default 5000)",
    )
    p.add_argument(
        "--itl-p90",
        type=_positive,
        default=100.0,
        metavar="MS",
        help="ITL p90 target, ms (default 100)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--rate", type=_positive, metavar="REQ/S",
        help="Poisson arrivals: also print how many copies of each plan serve this rate",
    )  # fmt: skip
    load.add_argument(
        "--concurrency", type=_positive_int, metavar="N",
        help="a closed loop of N clients over the whole deployment, each sending its next "
        "request when the last ends (as dsmesh bench --concurrency): plans are scored at "
        "the throughput and latencies N clients get; without it (or --rate) at the most "
        "requests/s the targets allow",
    )  # fmt: skip
    p.add_argument(
        "--mode", choices=("both", "pd", "unified"), default="both", help="deployments to search"
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=512,
        metavar="N",
        help="largest running batch per GPU to try",
    )
    p.add_argument(
        "--mtp-acceptance",
        type=float,
        default=0.0,
        metavar="A",
        help="MTP draft acceptance (0-1) to also try MTP; 0: off",
    )
    p.add_argument(
        "--eplb-load",
        type=Path,
        metavar="FILE",
        help="expert load file (docs/EPLB.md) for the balancedness, instead of the synthetic load",
    )
    p.add_argument("--top", type=int, default=5, metavar="K", help="plans to print (default 5)")
    p.add_argument(
        "--k8s-overlay",
        type=Path,
        metavar="DIR",
        help="write a kustomize overlay running the best PD plan here",
    )
    p.add_argument(
        "--model-path", metavar="PATH",
        help="the checkpoint's path in the printed command and overlay (default: --model when "
        "it is a folder, else /models/DeepSeek-V3, -R1, -V2 or -V2-Lite)",
    )  # fmt: skip
    p.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="plot throughput against ITL p90 (needs matplotlib)",
    )
    p.add_argument(
        "--validate", action="store_true", help="print the model against recorded runs and exit"
    )
    p.add_argument(
        "--questions",
        action="store_true",
        help="print the model's answers to the seed's questions and exit",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.plan.command import run_plan

    return run_plan(args)
