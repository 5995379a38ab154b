"""OpenAI requests with ``max_tokens`` omitted, at high concurrency, through ``dsmesh up``.

    python -m dsmesh.bench.no_max_tokens --out DIR [--kinds unified,pd] [--shape v2-lite]
        [--context 2048] [--concurrency 256] [--num-prompts 512] [--input-len 1000]

The target: with ``max_tokens`` omitted (OpenAI's "up to the context limit"),
concurrency 256 runs with no failure and no up-front reservation.

1. Writes (or reuses) a random-weight checkpoint of ``--shape`` whose config declares a
   context of ``--context`` tokens (dsmesh/bench/checkpoint.py), so requests that run to the
   context limit end in reasonable time.
2. For each of ``--kinds``, starts ``dsmesh up`` (``unified``: one unified instance; ``pd``:
   a prefill and a decode) with a KV pool of ``--max-total-tokens`` (default: half of
   concurrency x context, so pages must be taken on demand and requests retracted), every
   instance's Prometheus metrics on (``--instance-metrics-port``) and
   ``--max-running-requests`` = concurrency.
3. Runs ``dsmesh bench --backend openai --output-len context``: ``/v1/completions`` with
   random token-id prompts of ``--input-len`` tokens, no ``max_tokens``, greedy, EOS honoured
   (as such a client sends them). Random weights rarely emit EOS (``--shape tiny`` has a
   512-token vocabulary, so there it is likelier), so most requests run to the context limit.
4. Reports requests by outcome (ok, failed, refused with 429, timed out), output tokens/s,
   output tokens per request and how many reached the context limit, retractions, peak KV
   pages used (instances' metrics, sampled every ``--sample-s``) against the pool, and the
   tokens reserved ahead at admission (``dsmesh_kv_reserved_ahead_tokens_total``): 0 on
   unified and decode instances means no request took pages for tokens it did not have yet;
   a PD prefill takes its first new token's, 1 per request. JSON to ``DIR/no_max_tokens.json``
   (by kind), logs and ``dsmesh bench``'s JSON in ``DIR/KIND``; exit status 1 unless every
   request of every kind succeeded with no up-front reservation.

``--shape tiny --device cpu --context 512 --input-len 200 --num-prompts 8 --concurrency 8
--max-total-tokens 2048`` runs it on the CPU in under a minute (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_gpu import free_port_run, mesh_up, scrape

COUNTERS = (
    "dsmesh_retractions_total",
    "dsmesh_retracted_tokens_total",
    "dsmesh_kv_reserved_ahead_tokens_total",
)
GAUGES = ("dsmesh_kv_pages_used", "dsmesh_kv_pages_free", "dsmesh_requests_running")


class PeakSampler:
    """Polls instances' gauges on a thread until stopped; keeps each one's peak."""

    def __init__(self, urls: dict[str, str], period_s: float) -> None:
        self.urls = urls
        self.period_s = period_s
        self.peaks: dict[str, dict[str, float]] = {name: {} for name in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, url in self.urls.items():
                sample = scrape(url)
                peaks = self.peaks[name]
                if GAUGES[0] in sample and GAUGES[1] in sample:
                    sample["total_pages"] = sample[GAUGES[0]] + sample[GAUGES[1]]
                for key in (GAUGES[0], GAUGES[2], "total_pages"):
                    if key in sample:
                        peaks[key] = max(peaks.get(key, 0.0), sample[key])
            self._stop.wait(self.period_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[PeakSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)


def instance_figures(
    before: dict[str, float], after: dict[str, float], peaks: dict[str, float]
) -> dict[str, float]:
    """One instance's counters over the run and its sampled peaks."""
    out = {k.removeprefix("dsmesh_"): after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    out["peak_pages_used"] = peaks.get(GAUGES[0], 0.0)
    out["total_pages"] = peaks.get("total_pages", 0.0)
    out["peak_running"] = peaks.get(GAUGES[2], 0.0)
    return out


def request_figures(result: dict[str, Any], context: int) -> dict[str, Any]:
    """Outcomes and output lengths from a ``dsmesh bench --json-details`` result."""
    s, records = result["summary"], result.get("requests", [])
    ok = [r for r in records if r["success"]]
    at_limit = [r for r in ok if r["prompt_tokens"] + r["output_tokens"] >= context]
    return {
        "requests": len(records),
        "ok": s["completed"],
        "failed": s["failed"],
        "refused": s["refused"],
        "timed_out": s["timed_out"],
        "failed_other": s["failed"] - s["refused"] - s["timed_out"],
        "sent_max_tokens": sum(1 for r in records if r["max_new_tokens"] is not None),
        "output_throughput": s["output_throughput"],
        "duration_s": s["duration_s"],
        "output_tokens_mean": s["output_tokens"]["mean"],
        "output_tokens_min": min((r["output_tokens"] for r in ok), default=0),
        "output_tokens_max": s["output_tokens"]["max"],
        "reached_context_limit": len(at_limit),
        "ended_by_eos": sum(1 for r in ok if r["finish_reason"] == "stop"),
        "errors": result.get("errors", [])[:3],
    }


def reserved_up_front(instances: dict[str, dict[str, float]], num_requests: int) -> bool:
    """Whether any request took pages for tokens it did not have yet, beyond PD prefill's
    first new token (at most one per request, warm-ups included)."""
    for name, figures in instances.items():
        ahead = figures["kv_reserved_ahead_tokens_total"]
        allowed = num_requests if name.startswith("prefill") else 0
        if ahead > allowed:
            return True
    return False


def run_bench(url: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    command = [
        *(sys.executable, "-m", "dsmesh", "bench", "--backend", "openai", "--url", url),
        *("--output-len", "context", "--input-len", str(args.input_len)),
        *("--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)),
        *("--max-token-id", str(args.max_token_id), "--seed", str(args.seed)),
        *("--warmup", str(args.warmup), "--warmup-concurrency", str(max(1, args.warmup))),
        *("--request-timeout", str(args.request_timeout)),
        *("--no-progress", "--json", str(path), "--json-details"),
    ]
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if not path.exists():
        raise RuntimeError(f"dsmesh bench wrote nothing: {done.stderr[-2000:]}")
    return json.loads(path.read_text())


def up_flags(args: argparse.Namespace, kind: str, metrics_port: int) -> list[str]:
    pool = args.max_total_tokens or args.concurrency * args.context // 2
    flags = ["--device", args.device, *shlex.split(args.up_args)]
    flags += ["--max-total-tokens", str(pool), "--max-running-requests", str(args.concurrency)]
    flags += ["--instance-metrics-port", str(metrics_port)]
    if kind == "unified":
        flags += ["--prefill", "0", "--decode", "0", "--unified", "1"]
    return flags


def run_kind(args: argparse.Namespace, kind: str, model: str) -> dict[str, Any]:
    """One mesh of ``kind``: start it, run the requests, gather the figures."""
    out: Path = args.out / kind
    flags = up_flags(args, kind, free_port_run(4))
    with mesh_up(model, flags, out / "logs", args.start_timeout) as mesh:
        urls = mesh.instance_metrics
        before = {name: scrape(url) for name, url in urls.items()}
        with PeakSampler(urls, args.sample_s).running() as sampler:
            rest_url = mesh.metrics_url.removesuffix("/metrics")
            result = run_bench(rest_url, args, out / "bench.json")
        after = {name: scrape(url) for name, url in urls.items()}
    instances = {
        name: instance_figures(before[name], after[name], sampler.peaks[name]) for name in urls
    }
    figures = request_figures(result, args.context)
    sent = figures["requests"] + args.warmup
    return {
        "kind": kind,
        "shape": args.shape,
        "context": args.context,
        "concurrency": args.concurrency,
        "up_args": flags,
        **figures,
        "retractions": sum(f["retractions_total"] for f in instances.values()),
        "reserved_up_front": reserved_up_front(instances, sent),
        "instances": instances,
    }


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every kind of ``--kinds`` on one checkpoint; the reports by kind."""
    from dsmesh.bench.checkpoint import write_random_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or (
        Path(os.environ.get("TMPDIR", "/tmp")) / f"dsmesh-{args.shape}-ctx{args.context}"
    )
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    model = str(write_random_checkpoint(args.shape, model_dir, device, 0, 4, args.context))
    reports: dict[str, dict[str, Any]] = {}
    for kind in args.kinds:
        try:
            reports[kind] = run_kind(args, kind, model)
        except Exception as exc:  # keep the other kind's figures
            reports[kind] = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}
        (args.out / "no_max_tokens.json").write_text(json.dumps(reports, indent=1))
    for report in reports.values():
        print(summary_text(report), flush=True)
    return reports


def summary_text(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['kind']} mesh: {r['error']}"
    lines = [
        f"{r['kind']} mesh, context {r['context']}, concurrency {r['concurrency']}, "
        f"max_tokens sent by {r['sent_max_tokens']} of {r['requests']} requests",
        f"  ok {r['ok']}, failed {r['failed']} (refused {r['refused']}, timed out "
        f"{r['timed_out']}, other {r['failed_other']})",
        f"  output {r['output_throughput']:.1f} tok/s over {r['duration_s']:.1f} s; per request "
        f"mean {r['output_tokens_mean']:.1f}, min {r['output_tokens_min']}, max "
        f"{r['output_tokens_max']}; {r['reached_context_limit']} reached the context limit, "
        f"{r['ended_by_eos']} ended by EOS",
        f"  retractions {r['retractions']:.0f}; up-front reservation: "
        f"{'YES' if r['reserved_up_front'] else 'none'}",
    ]
    for name, f in r["instances"].items():
        lines.append(
            f"  {name}: peak {f['peak_pages_used']:.0f} of {f['total_pages']:.0f} pages, peak "
            f"{f['peak_running']:.0f} running, {f['retractions_total']:.0f} retractions, "
            f"{f['kv_reserved_ahead_tokens_total']:.0f} tokens reserved ahead"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("no-max-tokens"))
    ap.add_argument(
        "--kinds",
        type=_kinds,
        default=["unified"],
        help="meshes to run, one after the other: unified, pd or unified,pd (default: unified)",
    )
    ap.add_argument("--shape", default="v2-lite", help="v2-lite, v3-layers, tiny, tiny-v3")
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint folder")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=2048, help="max_position_embeddings")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--max-token-id", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool per instance in tokens (default: concurrency x context / 2)",
    )
    ap.add_argument("--up-args", default="", help="more `dsmesh up` flags (a quoted string)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed requests first")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--sample-s", type=float, default=0.5, help="gauge sampling period")
    return ap.parse_args(argv)


def _kinds(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    if not kinds or any(k not in ("unified", "pd") for k in kinds):
        raise argparse.ArgumentTypeError(f"expected unified, pd or both, got {text!r}")
    return kinds


def passed(report: dict[str, Any]) -> bool:
    """Every request succeeded and none was admitted with an up-front reservation."""
    return "error" not in report and report["failed"] == 0 and not report["reserved_up_front"]


def main(argv: list[str] | None = None) -> int:
    reports = run(parse_args(argv))
    return 0 if all(passed(r) for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
