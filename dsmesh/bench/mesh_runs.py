"""The serving benchmark's driver for a mesh target: the load levels, one ``dsmesh bench
--backend grpc`` run per level and repeat (its counters and gauges read around it), the
figures condensed from its JSON, the requests by outcome, the median run, the overload burst,
and one line per run."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_metrics import (
    GaugeSampler,
    handoff_figures,
    pages_per_run,
    scrape,
)
from dsmesh.bench.mesh_process import free_port_run, mesh_up, py_spy

SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_throughput",
)


@dataclass(frozen=True)
class Level:
    concurrency: int
    num_prompts: int
    repeats: int = 1

    @classmethod
    def parse(cls, text: str) -> Level:
        parts = [int(x) for x in text.split(":")]
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise argparse.ArgumentTypeError(
                f"a level is CONCURRENCY:PROMPTS[:REPEATS] of positive integers, got {text!r}"
            )
        return cls(*parts)


def parse_levels(text: str) -> list[Level]:
    return [Level.parse(t) for t in text.split(",") if t]


def run_seed(level_index: int, repeat: int) -> int:
    """Fresh prompts per run, so no run hits a prefix another one cached."""
    return 1000 * (level_index + 1) + repeat


def dsmesh_bench(
    grpc_addr: str, level: Level, seed: int, args: argparse.Namespace, json_path: Path
) -> dict[str, Any]:
    """One ``dsmesh bench --backend grpc`` run; its JSON (per-request details included)."""
    command = [
        sys.executable,
        "-m",
        "dsmesh",
        "bench",
        "--backend",
        "grpc",
        "--grpc-addr",
        grpc_addr,
        "--num-prompts",
        str(level.num_prompts),
        "--max-concurrency",
        str(level.concurrency),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--max-token-id",
        str(args.max_token_id),
        "--seed",
        str(seed),
        "--warmup",
        str(max(args.warmup, level.concurrency)),
        "--warmup-concurrency",
        str(level.concurrency),
        "--request-timeout",
        str(args.request_timeout),
        "--no-progress",
        "--json",
        str(json_path),
        "--json-details",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if not json_path.exists():
        raise RuntimeError(f"dsmesh bench wrote nothing: {done.stderr[-2000:]}")
    return json.loads(json_path.read_text())


def classify(result: dict[str, Any]) -> dict[str, int]:
    """Requests by outcome: ok, refused (RESOURCE_EXHAUSTED / 429), timed out, other."""
    out = {"ok": 0, "refused": 0, "timed_out": 0, "failed_other": 0}
    for r in result.get("requests", []):
        err = r.get("error", "")
        if r.get("success"):
            out["ok"] += 1
        elif "RESOURCE_EXHAUSTED" in err or "429" in err:
            out["refused"] += 1
        elif "DEADLINE_EXCEEDED" in err or "TIMED_OUT" in err or "timed out" in err:
            out["timed_out"] += 1
        else:
            out["failed_other"] += 1
    return out


def condense(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the table shows, from a ``dsmesh bench`` JSON (or the engine's)."""
    s = result["summary"]
    out = {k: s[k] for k in SUMMARY_KEYS}
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[name] = {q: s[name][q] for q in ("mean", "p50", "p99")}
    out["outcomes"] = classify(result)
    out["errors"] = result.get("errors", [])[:3]
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output throughput (its own figures, not a mix of runs)."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    return ordered[(len(ordered) - 1) // 2]


def bench_mesh(
    target: str, kind: str, extra: list[str], model: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    up_args = ["--device", args.device, *shlex.split(args.engine_args)]
    up_args += shlex.split(args.pd_args if kind == "pd" else args.unified_args) + extra
    if kind == "unified":
        up_args += ["--prefill", "0", "--decode", "0", "--unified", "1"]
    if "--instance-metrics-port" not in up_args:  # the engines' gauges and counters
        up_args += ["--instance-metrics-port", str(free_port_run(16))]
    result: dict[str, Any] = {"up_args": up_args, "levels": []}
    with mesh_up(model, up_args, out / "logs" / target, args.start_timeout) as mesh:
        urls = mesh.instance_metrics
        for i, level in enumerate(args.levels):
            runs = []
            for repeat in range(level.repeats):
                before = scrape(mesh.metrics_url)
                engines_before = {name: scrape(url) for name, url in urls.items()}
                sampler = GaugeSampler(urls)
                path = out / f"{target}-c{level.concurrency}-r{repeat}.json"
                spies = []
                if args.py_spy and repeat == 0 and level.concurrency == args.py_spy_level:
                    spies = py_spy(mesh.log, out / f"pyspy-{target}", args.py_spy)
                with sampler:
                    raw = dsmesh_bench(mesh.grpc_addr, level, run_seed(i, repeat), args, path)
                run = condense(raw)
                for spy in spies:
                    spy.wait(60)
                run["handoff"] = handoff_figures(before, scrape(mesh.metrics_url))
                engines_after = {name: scrape(url) for name, url in urls.items()}
                run["handoff"]["kv_pages_per_run"] = pages_per_run(engines_before, engines_after)
                run["engines"] = sampler.summary()
                runs.append(run)
                print(f"  {target} c={level.concurrency} run {repeat}: {brief(run)}", flush=True)
            result["levels"].append(
                {"level": vars(level), "median": median_run(runs), "runs": runs}
            )
        if args.overload is not None:
            path = out / f"{target}-overload.json"
            run = condense(dsmesh_bench(mesh.grpc_addr, args.overload, 99, args, path))
            result["overload"] = {"level": vars(args.overload), **run}
            print(f"  {target} overload: {run['outcomes']}", flush=True)
    return result


def brief(run: dict[str, Any]) -> str:
    waits = [
        f"{name} {gauge} {v['mean']:.1f}/{v['max']:.0f}"
        for name, gauges in run.get("engines", {}).items()
        for gauge, v in gauges.items()
        if gauge != "running"
    ]
    return (
        f"{run['output_throughput']:.0f} out tok/s, TTFT p50 {run['ttft_ms']['p50']:.0f} ms, "
        f"TPOT mean {run['tpot_ms']['mean']:.2f} ms, {run['duration_s']:.1f} s, "
        f"{run['outcomes']}"
        + (f"\n    steps {run['steps']}" if "steps" in run else "")
        + (f"\n    waiting (mean/max): {', '.join(waits)}" if waits else "")
        + (
            f"; KV pages per copy run {run['handoff']['kv_pages_per_run']:.1f}"
            if run.get("handoff", {}).get("kv_pages_per_run")
            else ""
        )
    )
