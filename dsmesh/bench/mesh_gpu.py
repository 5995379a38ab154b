"""The serving benchmark: the mesh a user runs against its baselines, on the same GPU(s), with
the same checkpoint, in one command.

    python -m dsmesh.bench.mesh_gpu --out DIR [--shape v2-lite] [--targets pd,unified,engine]
        [--levels 1:16,64:128:3,256:512] [--engine-args "--max-running-requests 256"]

1. Writes (or reuses) a random-weight checkpoint of ``--shape`` (dsmesh/bench/checkpoint.py).
2. For each target, the same requests (random token ids, ``--input-len`` prompt tokens,
   ``--output-len`` new tokens, EOS ignored, greedy) at each level ``CONCURRENCY:PROMPTS``
   (``:REPEATS`` runs it several times with fresh prompts; medians are reported), each run
   after an untimed wave of ``CONCURRENCY`` requests (a warm server: graphs and Triton
   kernels for those batch shapes exist):
   - ``pd``: ``dsmesh up`` (kv_broker, prefill, decode, gateway), measured with
     ``dsmesh bench --backend grpc``, as a user runs them;
   - ``unified``: ``dsmesh up --prefill 0 --decode 0 --unified 1``, the same way;
   - ``engine``: the engine in-process, through ``dsmesh bench --backend offline``'s backend
     with the same engine flags, loaded once for every level. With ``--kernel-ref`` the same
     process also measures the engine's prefill rate and decode step at each level's batch,
     the prediction that the unified instance is held to.
3. ``--overload CONCURRENCY:PROMPTS`` sends a burst larger than the KV pool to each mesh
   target and counts refusals (RESOURCE_EXHAUSTED / 429) apart from other failures.
4. Reports req/s, output and total tokens/s, TTFT and TPOT p50 / p99, per request handoff
   time and KV bytes/s (from the gateway's /metrics), as a table and ``DIR/mesh_gpu.json``;
   per run also each engine's gauges sampled every 0.25 s (requests queued, decode's line for
   pages: where requests wait) and the KV pages per copy run of the handoffs (from the
   engines' /metrics, ``--instance-metrics-port``).

``--variant NAME:KIND:FLAGS`` adds a mesh of kind ``pd`` or ``unified`` with more
``dsmesh up`` flags (an A/B in the same run); ``--py-spy SECONDS`` samples every engine
process's Python stacks during the first run at ``--py-spy-level`` (py-spy on the PATH).

Every mesh's logs land in ``DIR/logs/<target>``. ``--shape tiny --device cpu`` runs every
code path on the CPU in a minute (a smoke test; its numbers mean nothing).

This module is the command line: its flags, the targets run one after another and the results
JSON. A mesh's process lives in mesh_process.py, what is read from its metrics in
mesh_metrics.py, the runs against it in mesh_runs.py, the in-process engine target in
mesh_engine.py and the table in mesh_report.py. The names other benchmarks import from here
are re-exported below.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_engine import bench_engine, engine_levels
from dsmesh.bench.mesh_metrics import scrape
from dsmesh.bench.mesh_process import free_port_run, mesh_up
from dsmesh.bench.mesh_report import ratios, table
from dsmesh.bench.mesh_runs import Level, bench_mesh, parse_levels

__all__ = [  # the command line, and the helpers imported from here elsewhere
    "free_port_run",
    "main",
    "mesh_up",
    "parse_args",
    "scrape",
]

TARGETS = ("pd", "unified", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("mesh-gpu-results"))
    ap.add_argument("--shape", default="v2-lite", help="v2-lite, v3-layers, tiny, tiny-v3")
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint folder to reuse")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--levels", type=parse_levels, default=parse_levels("1:16,64:128:3,256:512"))
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-token-id", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument(
        "--engine-args", default="", help="engine flags for every target (a quoted string)"
    )
    ap.add_argument("--pd-args", default="", help="more `dsmesh up` flags for the PD mesh")
    ap.add_argument("--unified-args", default="", help="more `dsmesh up` flags for unified")
    ap.add_argument("--overload", type=Level.parse, default=None, metavar="CONC:PROMPTS")
    ap.add_argument("--kernel-ref", action="store_true", help="engine: kernel-level prediction")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KIND:FLAGS",
        help="another mesh (KIND pd or unified) with more dsmesh up flags; repeatable",
    )
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--py-spy-level", type=int, default=64, metavar="CONCURRENCY")
    ap.add_argument("--kernel-ref-prompts", type=int, default=16)
    ap.add_argument("--v3-layers", type=int, default=4)
    ap.add_argument("--engine-child", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.engine_child is not None:
        engine_child(args.engine_child)
        return {}
    from dsmesh.bench.checkpoint import write_random_checkpoint

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"dsmesh-{args.shape}"
    model = str(write_random_checkpoint(args.shape, model_dir, args.device, 0, args.v3_layers))
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": _device_name(args.device),
        "shape": args.shape,
        "argv": sys.argv[1:],
        "levels": [vars(lv) for lv in args.levels],
        "targets": {},
    }
    results["levels"] = args.levels
    runs: list[tuple[str, str, list[str]]] = []
    for target in [t for t in args.targets.split(",") if t]:
        if target not in TARGETS:
            raise SystemExit(f"--targets: unknown {target!r} (known: {', '.join(TARGETS)})")
        runs.append((target, target, []))
    for spec in args.variant:
        name, kind, flags = spec.split(":", 2)
        if kind not in ("pd", "unified"):
            raise SystemExit(f"--variant {spec}: KIND must be pd or unified")
        runs.append((name, kind, shlex.split(flags)))
    for target, kind, extra in runs:
        start = time.perf_counter()
        try:
            if target == "engine":
                res = bench_engine(model, args, out)
            else:
                res = bench_mesh(target, kind, extra, model, args, out)
        except Exception as exc:  # keep the other targets' figures
            res = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{target} failed: {exc}", flush=True)
        res["seconds"] = time.perf_counter() - start
        results["targets"][target] = res
        _save(results, out)
    results["ratios"] = ratios(results)
    _save(results, out)
    print(table(results), flush=True)
    return results


def engine_child(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    args = parse_args(spec["argv"])
    out = spec_path.parent
    asyncio.run(engine_levels(spec["model"], args, out))


def _save(results: dict[str, Any], out: Path) -> None:
    data = dict(results, levels=[vars(lv) for lv in results["levels"]])
    (out / "mesh_gpu.json").write_text(json.dumps(data, indent=1, default=str))


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    main()
