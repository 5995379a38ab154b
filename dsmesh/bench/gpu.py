"""GPU benchmark: dsmesh on random-weight DeepSeek shapes against the hardware and transformers.

    python -m dsmesh.bench.gpu --out results.json [--parts v2,v3,hf] [--tiny] [--device cuda]

Reports, as a table and JSON (written after every part, so a cut-short run keeps what it did):

- ceilings measured here: device copy bandwidth (bytes read + written) and the dense matmul
  rate (bf16 on CUDA);
- a. DeepSeek-V2-Lite shape (the released config, random bf16 weights in the engine's own
  model classes): prefill tokens/s at 2000-token prompts and its FLOP rate against the
  matmul ceiling; decode tokens/s at batch 1/32/128/256 with 2000-token contexts, with and
  without CUDA graphs, against the HBM roofline (weights touched + KV read over the copy
  bandwidth);
- b. DeepSeek-V3 layer shape (a few MoE layers, small vocabulary; on CUDA its routed experts,
  attention projections but kv_b_proj and shared experts in FP8 128x128 blocks as
  DeepSeek-V3 ships them, ``--v3-dense-dtype bf16`` for the non-expert linears in bf16, the
  shape measured before 2026-12-06): prefill and decode throughput per layer against the
  seed's per-GPU figures scaled per layer; with
  ``--kv-cache-dtype auto,fp8_e4m3`` the decode steps again with each further KV cache
  dtype (``decode["kv_fp8_e4m3"]``), e.g. bf16 against FP8 KV at 32K contexts:
  ``--parts v3 --v3-batch 64 --context 32768 --kv-cache-dtype auto,fp8_e4m3``;
- c. transformers' DeepseekV2ForCausalLM on the V2-Lite shape (same GPU, batch and
  context): prefill and decode tokens/s, and dsmesh's speed-up.

Decode requests are placed as a decode instance receives them (``reserve`` + ``activate``:
the prompt's KV is already in the pages, here random values), so decode is measured without
prefilling 256 x 2000 tokens first. ``--tiny`` runs every code path on tiny shapes (CPU
smoke test); its numbers mean nothing.

This module is the command line: its flags, the run of the parts and the results JSON. The
parts live in gpu_v2.py, gpu_v3.py and gpu_hf.py, the report in gpu_report.py; what they stand
on in random_model.py (shapes, random weights), roofline.py (ceilings, bytes and FLOPs),
engine_steps.py (timed engine steps) and step_profiles.py (profiler tables). The names other
benchmarks and tests import from here are re-exported below.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import torch

from dsmesh.bench.engine_steps import (
    add_cpu_graph_runner,
    bench_decode,
    bench_prefill,
    graph_replay_seconds,
    make_engine,
)
from dsmesh.bench.gpu_hf import run_hf
from dsmesh.bench.gpu_report import print_table, targets
from dsmesh.bench.gpu_v2 import run_v2
from dsmesh.bench.gpu_v3 import run_v3
from dsmesh.bench.random_model import (
    build_dsmesh,
    init_random_,
    random_prompt,
    use_fp8_experts,
    v2_lite_config,
    v3_layers_config,
)
from dsmesh.bench.roofline import measure_ceilings, prefill_flops, sync, weight_bytes_touched
from dsmesh.engine.kv.pool import KV_CACHE_DTYPES

__all__ = [  # the command line, and the helpers imported from here elsewhere
    "add_cpu_graph_runner",
    "bench_decode",
    "bench_prefill",
    "build_dsmesh",
    "graph_replay_seconds",
    "init_random_",
    "main",
    "make_engine",
    "parse_args",
    "prefill_flops",
    "random_prompt",
    "sync",
    "use_fp8_experts",
    "v2_lite_config",
    "v3_layers_config",
    "weight_bytes_touched",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results.json"))
    ap.add_argument("--parts", default="v2,v3,hf", help="comma list of v2, v3, hf")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--hf-batches", default="1,32,128")
    ap.add_argument("--profile", action="store_true", help="kernel tables of decode forwards")
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time decode without CUDA graphs (the graph speed-up)",
    )
    ap.add_argument(
        "--attention-ab",
        action="store_true",
        help="also time decode with the MLA kernel 'auto' did not pick (Triton or FlashInfer)",
    )
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--v3-layers", type=int, default=4)
    ap.add_argument("--v3-batch", type=int, default=256)
    ap.add_argument(
        "--v3-dense-dtype",
        choices=("fp8", "bf16"),
        default="fp8",
        help="V3 layers on CUDA: the attention projections (but kv_b_proj) and shared experts "
        "in block-scaled FP8 as DeepSeek-V3 ships them (fp8), or in bf16 (the shape measured "
        "before 2026-12-06)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma list of KV cache dtypes (auto, fp8_e4m3): the first for every engine, "
        "the others time V3's decode again in the same run (decode['kv_<dtype>'])",
    )
    args = ap.parse_args(argv)
    args.kv_cache_dtypes = args.kv_cache_dtype.split(",")
    for name in args.kv_cache_dtypes:
        if name not in KV_CACHE_DTYPES:
            ap.error(f"--kv-cache-dtype: {name!r} is not one of {KV_CACHE_DTYPES}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    args.parts = set(args.parts.split(","))
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    import transformers

    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers_version": transformers.__version__,
        "tiny": args.tiny,
        "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
    }
    results["args"] = json.loads(json.dumps(results["args"], default=str))
    results["ceilings"] = measure_ceilings(device, args.tiny)
    print(f"ceilings: {results['ceilings']}", flush=True)

    def save() -> None:
        results["targets"] = targets(results)
        args.out.write_text(json.dumps(results, indent=2))

    for part, fn in (("v2", run_v2), ("v3", run_v3), ("hf", run_hf)):
        if part not in args.parts:
            continue
        t = time.perf_counter()
        try:
            if part == "hf":
                fn(args, device, results)
            else:
                fn(args, device, results["ceilings"], results)
        except Exception as exc:  # keep the other parts' figures
            results.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
            print(f"part {part} failed: {exc!r}", flush=True)
            if args.tiny:
                raise
        results.setdefault("part_seconds", {})[part] = time.perf_counter() - t
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    save()
    print_table(results)
    return results


if __name__ == "__main__":
    main()
