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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS = ("pd", "unified", "engine")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_seed(level_index: int, repeat: int) -> int:
    """Fresh prompts per run, so no run hits a prefix another one cached."""
    return 1000 * (level_index + 1) + repeat


# ---- the gateway's handoff metrics -------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
HANDOFF_METRICS = (
    "dsmesh_kv_handoff_seconds_sum",
    "dsmesh_kv_handoff_seconds_count",
    "dsmesh_kv_transfer_bytes_total",
    "dsmesh_kv_write_seconds_total",
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labels summed (the few we read have none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def metrics_urls(up_args: list[str]) -> dict[str, str]:
    """Each engine instance's /metrics URL, by name, for these ``dsmesh up`` flags."""
    from dsmesh.cli.main import build_parser
    from dsmesh.cli.mesh_config import instance_metrics_ports
    from dsmesh.cli.up import mesh_config_from
    from dsmesh.runtime.address import LOOPBACK

    config = mesh_config_from(build_parser().parse_args(["up", *up_args]))
    ports = instance_metrics_ports(config)
    return {name: f"http://{LOOPBACK}:{port}/metrics" for name, port in ports.items()}


def scrape(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return parse_metrics(resp.read().decode())
    except OSError:
        return {}


def handoff_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request handoff time (what the KV handoff added to TTFT) and KV bytes/s over a
    run, from the deltas of the gateway's counters."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in HANDOFF_METRICS}
    count = d["dsmesh_kv_handoff_seconds_count"]
    write_s = d["dsmesh_kv_write_seconds_total"]
    nbytes = d["dsmesh_kv_transfer_bytes_total"]
    return {
        "handoffs": count,
        "handoff_ms_mean": d["dsmesh_kv_handoff_seconds_sum"] / count * 1e3 if count else 0.0,
        "kv_bytes_per_request": nbytes / count if count else 0.0,
        "kv_GBps": nbytes / write_s / 1e9 if write_s > 0 else 0.0,
    }


# Each engine instance's gauges sampled during a run: where the requests wait.
INSTANCE_GAUGES = (
    "dsmesh_requests_running",
    "dsmesh_requests_waiting",  # prefill / unified: queued; decode: waiting for KV
    "dsmesh_requests_in_line",  # decode: in line for pages and a slot
)
PAGE_COUNTERS = ("dsmesh_kv_transfer_pages_total", "dsmesh_kv_transfer_page_runs_total")


class GaugeSampler:
    """Scrapes every engine instance's /metrics every ``period_s`` on a thread while the
    block runs; :meth:`summary` gives each gauge's mean and max per instance."""

    def __init__(self, urls: dict[str, str], period_s: float = 0.25) -> None:
        self.urls = urls
        self.period_s = period_s
        self.samples: dict[str, dict[str, list[float]]] = {name: {} for name in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, url in self.urls.items():
                got = scrape(url)
                for gauge in INSTANCE_GAUGES:
                    if gauge in got:
                        self.samples[name].setdefault(gauge, []).append(got[gauge])

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            name: {
                gauge.removeprefix("dsmesh_requests_"): {
                    "mean": sum(values) / len(values),
                    "max": max(values),
                }
                for gauge, values in gauges.items()
                if values
            }
            for name, gauges in self.samples.items()
        }


def pages_per_run(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> float:
    """KV pages written per run of pages consecutive on both sides, over all prefills, from
    their counters' deltas (1.0: every page its own copy per layer; 0.0: nothing written)."""
    pages, runs = (
        sum(after[n].get(c, 0.0) - before[n].get(c, 0.0) for n in after) for c in PAGE_COUNTERS
    )
    return pages / runs if runs else 0.0


# ---- running a mesh ----------------------------------------------------------------------------


@dataclass
class Mesh:
    process: subprocess.Popen[str]
    grpc_addr: str
    metrics_url: str
    log: Path


@contextlib.contextmanager
def mesh_up(
    model: str, up_args: list[str], log_dir: Path, start_timeout_s: float
) -> Iterator[Mesh]:
    """``dsmesh up`` on free ports until the block ends (SIGINT, then SIGKILL)."""
    http, grpc_port = free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "dsmesh",
        "--log-level",
        "info",  # the engines' periodic step summaries go to their logs
        "up",
        "--model",
        model,
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(log_dir),
        *up_args,
    ]
    log = log_dir / "up.log"
    print(f"$ {shlex.join(command)}", flush=True)
    sink = open(log, "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        assert process.stdout is not None
        for line in process.stdout:
            sink.write(line)
            sink.flush()
            if "dsmesh mesh ready" in line:
                print(f"  {line.strip()} (log {log})", flush=True)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"dsmesh up not ready in {start_timeout_s:.0f}s; see {log}")
        else:
            raise RuntimeError(f"dsmesh up exited ({process.wait()}) before ready; see {log}")
        drain = _drain_in_background(process, sink)
        yield Mesh(process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http}/metrics", log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        with contextlib.suppress(Exception):
            drain.join(5)  # type: ignore[possibly-undefined]
        sink.close()


def _drain_in_background(process: subprocess.Popen[str], sink: Any):
    import threading

    def run() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sink.write(line)
            sink.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


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
    urls = metrics_urls(up_args)
    result: dict[str, Any] = {"up_args": up_args, "levels": []}
    with mesh_up(model, up_args, out / "logs" / target, args.start_timeout) as mesh:
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


def py_spy(up_log: Path, prefix: Path, seconds: float) -> list[subprocess.Popen]:
    """Sample the Python stacks of every engine process of a mesh (pids from ``dsmesh up``'s
    ready lines) for ``seconds``, per thread, as collapsed stacks in ``PREFIX-NAME.txt``."""
    if shutil.which("py-spy") is None:
        print("  py-spy is not on the PATH: no stack samples", flush=True)
        return []
    spies = []
    for name, pid in re.findall(
        r"^\s+((?:prefill|decode|unified)-\d+)\s+ready at \S+\s+pid (\d+)", up_log.read_text(), re.M
    ):
        command = [
            "py-spy",
            "record",
            "--pid",
            pid,
            "--duration",
            str(int(seconds)),
            "--rate",
            "100",
            "--threads",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            f"{prefix}-{name}.txt",
        ]
        spies.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return spies


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


# ---- the engine in-process ---------------------------------------------------------------------


def bench_engine(model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The engine baseline in a child process (the GPU is free again for the meshes after)."""
    spec = out / "engine-spec.json"
    spec.write_text(json.dumps({"model": model, "argv": sys.argv[1:]}))
    result_path = out / "engine.json"
    command = [sys.executable, "-m", "dsmesh.bench.mesh_gpu", "--engine-child", str(spec)]
    print(f"$ {shlex.join(command)}", flush=True)
    with open(out / "engine.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"the engine run failed ({code}); see {out / 'engine.log'}")
    return json.loads(result_path.read_text())


def engine_child(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    args = parse_args(spec["argv"])
    out = spec_path.parent
    asyncio.run(_engine_levels(spec["model"], args, out))


def _engine_config(model: str, args: argparse.Namespace):
    """The engine flags as ``dsmesh bench --backend offline`` takes them, with their
    process-wide settings (the GIL switch interval) applied to this process too."""
    from dsmesh.cli.common import add_engine_args, apply_process_flags, engine_config_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_args = ["--model", model, "--device", args.device, *shlex.split(args.engine_args)]
    parsed = parser.parse_args(engine_args)
    apply_process_flags(parsed)
    return engine_config_from(parsed)


async def _engine_levels(model: str, args: argparse.Namespace, out: Path) -> None:
    from dsmesh.bench.offline import OfflineBackend
    from dsmesh.bench.serving import (
        BenchConfig,
        result_json,
        run_benchmark,
        sample_random_requests,
        summarize,
    )

    config = _engine_config(model, args)
    backend = OfflineBackend(config)
    await backend.connect(args.start_timeout)
    assert backend.worker is not None
    profile = StepProfile(backend.worker.engine)
    result: dict[str, Any] = {"engine_config": repr(config), "levels": []}
    try:
        for i, level in enumerate(args.levels):
            runs = []
            for repeat in range(level.repeats):
                bench = BenchConfig(
                    backend="offline",
                    max_concurrency=level.concurrency,
                    warmup=max(args.warmup, level.concurrency),
                    warmup_concurrency=level.concurrency,
                    seed=run_seed(i, repeat),
                    request_timeout_s=args.request_timeout,
                    engine=config,
                )
                requests = sample_random_requests(
                    level.num_prompts,
                    (args.input_len, args.input_len),
                    (args.output_len, args.output_len),
                    (3, args.max_token_id),
                    bench.seed,
                )
                profile.reset()
                run_ = await run_benchmark(bench, requests, backend=backend)
                summary = summarize(run_.records, run_.duration_s)
                run = condense(result_json(bench, summary, run_, details=True))
                run["steps"] = profile.summary()
                runs.append(run)
                print(f"  engine c={level.concurrency} run {repeat}: {brief(run)}", flush=True)
            result["levels"].append(
                {"level": vars(level), "median": median_run(runs), "runs": runs}
            )
        if args.kernel_ref:
            assert backend.worker is not None
            engine = backend.worker.engine
            backend.worker.stop()
            result["kernel_ref"] = kernel_reference(engine, args)
    finally:
        await backend.close()
    (out / "engine.json").write_text(json.dumps(result, indent=1))


class StepProfile:
    """Where the engine's time goes during a run: every ``step()`` timed, by what it ran
    (decode rows, prefill tokens; a step that finished a decode launched ahead counts as
    decode of the same batch). Wraps the engine's methods: a benchmark's instrument only."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[float, int, int]] = []  # seconds, decode rows, prefill tokens
        self._last: tuple[int, int] = (0, 0)
        self._scheduled: tuple[int, int] | None = None
        schedule, step = engine.scheduler.schedule, engine.step

        def timed_schedule():
            chunks = schedule()
            decode = sum(1 for c in chunks if c.num_tokens == 1 and not c.request.is_prefilling)
            self._scheduled = (decode, sum(c.num_tokens for c in chunks) - decode)
            return chunks

        def timed_step(*a, **kw):
            self._scheduled = None
            t = time.perf_counter()
            out = step(*a, **kw)
            seconds = time.perf_counter() - t
            if out:
                what = self._scheduled or self._last
                self._last = what
                self.steps.append((seconds, *what))
            return out

        engine.scheduler.schedule = timed_schedule
        engine.step = timed_step

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, Any]:
        decode = [s for s in self.steps if s[2] == 0]
        mixed = [s for s in self.steps if s[2] > 0 and s[1] > 0]
        prefill = [s for s in self.steps if s[2] > 0 and s[1] == 0]

        def part(steps: list[tuple[float, int, int]]) -> dict[str, float]:
            total = sum(s[0] for s in steps)
            return {
                "steps": len(steps),
                "seconds": total,
                "mean_ms": total / len(steps) * 1e3 if steps else 0.0,
                "mean_rows": sum(s[1] for s in steps) / len(steps) if steps else 0.0,
                "prefill_tokens": sum(s[2] for s in steps),
            }

        return {"decode": part(decode), "mixed": part(mixed), "prefill": part(prefill)}


def kernel_reference(engine, args: argparse.Namespace) -> dict[str, Any]:
    """The engine's own prefill rate (prompts of ``--input-len``) and decode step time at each
    level's batch (context: prompt + half the new tokens), and the workload time they predict:
    every prompt token at the prefill rate, plus ``ceil(prompts / concurrency)`` waves of
    ``--output-len`` decode steps at that batch."""
    from dsmesh.bench.gpu import bench_decode, bench_prefill

    vocab = engine.model_config.vocab_size
    prompts = max(1, min(16, args.kernel_ref_prompts))
    seconds = bench_prefill(engine, vocab, args.input_len, prompts, repeats=3)
    prefill_rate = args.input_len * prompts / seconds
    context = args.input_len + args.output_len // 2
    levels = []
    for level in args.levels:
        step = bench_decode(engine, vocab, level.concurrency, context, 10, 3, True)
        waves = -(-level.num_prompts // level.concurrency)
        predicted = (
            level.num_prompts * args.input_len / prefill_rate + waves * args.output_len * step
        )
        levels.append(
            {
                "concurrency": level.concurrency,
                "decode_step_ms": step * 1e3,
                "predicted_s": predicted,
            }
        )
        print(
            f"  kernel ref c={level.concurrency}: step {step * 1e3:.2f} ms, "
            f"predicted {predicted:.2f} s",
            flush=True,
        )
    return {"prefill_tokens_per_s": prefill_rate, "context": context, "levels": levels}


# ---- report ------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'target':<8} {'conc':>5} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'dur s':>7} "
        f"{'handoff ms':>10} {'KV GB/s':>8} {'ok/refused/timeout/other':>25}"
    )
    lines = [head, "-" * len(head)]
    for target in results.get("targets", {}):
        res = results.get("targets", {}).get(target)
        if not res or "levels" not in res:
            continue
        for entry in res["levels"]:
            m = entry["median"]
            h = m.get("handoff", {})
            o = m["outcomes"]
            lines.append(
                f"{target:<8} {entry['level']['concurrency']:>5} "
                f"{m['request_throughput']:>7.2f} {m['output_throughput']:>10.0f} "
                f"{m['total_throughput']:>10.0f} {m['ttft_ms']['p50']:>9.1f} "
                f"{m['ttft_ms']['p99']:>9.1f} {m['tpot_ms']['p50']:>9.2f} "
                f"{m['tpot_ms']['p99']:>9.2f} {m['duration_s']:>7.2f} "
                f"{h.get('handoff_ms_mean', 0.0):>10.2f} {h.get('kv_GBps', 0.0):>8.1f} "
                f"{o['ok']:>7}/{o['refused']}/{o['timed_out']}/{o['failed_other']}"
            )
        if "overload" in res:
            o = res["overload"]["outcomes"]
            lines.append(
                f"{target:<8} overload {res['overload']['level']}: ok {o['ok']}, refused "
                f"{o['refused']}, timed out {o['timed_out']}, other failures {o['failed_other']}"
            )
    ref = results.get("targets", {}).get("engine", {}).get("kernel_ref")
    if ref:
        lines.append(f"kernel reference: prefill {ref['prefill_tokens_per_s']:.0f} tok/s")
        for lv in ref["levels"]:
            lines.append(
                f"  c={lv['concurrency']}: decode step {lv['decode_step_ms']:.2f} ms at context "
                f"{ref['context']}, workload predicted {lv['predicted_s']:.2f} s"
            )
    lines += [f"{k}: {v}" for k, v in results.get("ratios", {}).items()]
    return "\n".join(lines)


def ratios(results: dict[str, Any]) -> dict[str, str]:
    """The targets' comparisons (docs/BENCHMARKS.md), where both sides ran."""
    t = results.get("targets", {})

    def level(target: str, conc: int) -> dict[str, Any] | None:
        for entry in t.get(target, {}).get("levels", []):
            if entry["level"]["concurrency"] == conc:
                return entry["median"]
        return None

    out: dict[str, str] = {}
    for conc in sorted({lv.concurrency for lv in results["levels"]}):
        pd, uni, eng = level("pd", conc), level("unified", conc), level("engine", conc)
        if pd and uni:
            out[f"c{conc} pd/unified output tok/s"] = (
                f"{pd['output_throughput'] / uni['output_throughput']:.2f}"
            )
            out[f"c{conc} pd/unified TTFT p50"] = (
                f"{pd['ttft_ms']['p50'] / uni['ttft_ms']['p50']:.2f}"
            )
        if pd and eng:
            out[f"c{conc} pd - engine TTFT p50 (ms)"] = (
                f"{pd['ttft_ms']['p50'] - eng['ttft_ms']['p50']:+.1f}"
            )
            out[f"c{conc} pd - engine TPOT mean (ms)"] = (
                f"{pd['tpot_ms']['mean'] - eng['tpot_ms']['mean']:+.2f}"
            )
        ref = t.get("engine", {}).get("kernel_ref")
        if uni and ref:
            for lv in ref["levels"]:
                if lv["concurrency"] == conc:
                    out[f"c{conc} unified duration / kernel prediction"] = (
                        f"{uni['duration_s'] / lv['predicted_s']:.2f}"
                    )
    return out


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
