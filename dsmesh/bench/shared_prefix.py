"""The shared-prefix workload through ``dsmesh up``, with the prefix cache on and off.

    python -m dsmesh.bench.shared_prefix --model DIR [--kind unified|pd] [--concurrency 256]

Starts the mesh (``dsmesh.bench.mesh_gpu.mesh_up``) once with the prefix cache on and once with
``--no-prefix-cache``, runs ``dsmesh bench --workload shared-prefix`` against each (groups of
prompts sharing a long system prompt; defaults 64 x 16 prompts, 4000-token system prompt,
200-token question, 128 new tokens: the target's workload) and prints the throughput of both,
their ratio (target >= 2) and the cached tokens per request. JSON to ``--out``.

``--concurrency`` defaults to 256 requests in flight (with ``--up-args
"--max-running-requests 256"``, as the recorded runs have it, the instance runs them all at
once), close to sglang.bench_serving's generated-shared-prefix, which sends every request at
once. At 64 the cache-on run is bound by decode steps of 64 rows and the ratio is lower
(docs/BENCHMARKS.md has both).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_gpu import free_port_run, mesh_up, scrape

KEYS = ("output_throughput", "total_throughput", "mean_cached_tokens", "cache_hit_rate")
# the engine instances' counters over the run (their /metrics, summed over instances)
INSTANCE_COUNTERS = (
    "dsmesh_prefix_cache_evicted_pages_total",
    "dsmesh_prefix_waits_total",
    "dsmesh_retractions_total",
)


def bench(grpc_addr: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    command = [
        *(sys.executable, "-m", "dsmesh", "bench", "--backend", "grpc"),
        *("--grpc-addr", grpc_addr, "--workload", "shared-prefix"),
        *("--gsp-groups", str(args.groups), "--gsp-prompts-per-group", str(args.per_group)),
        *("--gsp-system-len", str(args.system_len)),
        *("--gsp-question-len", str(args.question_len)),
        *("--gsp-output-len", str(args.output_len)),
        *("--max-concurrency", str(args.concurrency), "--warmup", "4"),
        *("--no-progress", "--json", str(path)),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if not path.exists():
        raise RuntimeError(f"dsmesh bench wrote nothing: {done.stderr[-2000:]}")
    summary = json.loads(path.read_text())["summary"]
    return {k: summary[k] for k in (*KEYS, "ttft_ms", "completed", "failed")}


CACHE_RUNS = ("on", "off")


def cache_runs(text: str) -> list[str]:
    """``--caches``: ``both`` -> on, off; else the comma-separated runs, each on or off."""
    runs = list(CACHE_RUNS) if text == "both" else [c.strip() for c in text.split(",")]
    bad = [c for c in runs if c not in CACHE_RUNS]
    if bad or not runs:
        raise SystemExit(f"--caches {text}: expected on, off, both or on,off")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kind", choices=("unified", "pd"), default="unified")
    ap.add_argument("--up-args", default="--device cuda --dtype bfloat16", help="more flags")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=4000)
    ap.add_argument("--question-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--caches",
        default="both",
        help="which runs: on, off, or both (= on,off; a comma-separated list also works)",
    )
    ap.add_argument("--out", type=Path, default=Path("shared_prefix"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    up = shlex.split(args.up_args)
    if args.kind == "unified":
        up += ["--prefill", "0", "--decode", "0", "--unified", "1"]
    results: dict[str, Any] = {}
    for cache in cache_runs(args.caches):
        flags = [*up, "--prefix-cache" if cache == "on" else "--no-prefix-cache"]
        flags += ["--instance-metrics-port", str(free_port_run(4))]
        with mesh_up(args.model, flags, args.out / f"logs-{cache}", 600) as mesh:
            urls = mesh.instance_metrics
            before = [scrape(url) for url in urls.values()]
            results[cache] = bench(mesh.grpc_addr, args, args.out / f"cache-{cache}.json")
            after = [scrape(url) for url in urls.values()]
        for key in INSTANCE_COUNTERS:
            pairs = zip(after, before, strict=True)
            delta = sum(a.get(key, 0.0) - b.get(key, 0.0) for a, b in pairs)
            results[cache][key.removeprefix("dsmesh_").removesuffix("_total")] = delta
        print(f"cache {cache}: {json.dumps(results[cache])}", flush=True)
    if {"on", "off"} <= results.keys():
        ratio = results["on"]["output_throughput"] / results["off"]["output_throughput"]
        results["throughput_ratio"] = ratio
        print(f"output tok/s with the cache / without: {ratio:.2f}", flush=True)
    (args.out / "shared_prefix.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
