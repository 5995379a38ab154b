"""The fault benchmark: a mesh process SIGKILLed under load, against the same load undisturbed.

    python -m dsmesh.bench.faults --out DIR [--model DIR] [--target pd|unified]
        [--device cpu|cuda] [--up-args "FLAGS"] [--concurrency C] [--num-requests N]
        [--input-len L] [--output-len L] [--kill decode-0|prefill-0|kv-broker|unified-0]
        [--kill-at SECONDS]

1. Starts the mesh users run, supervised: ``dsmesh up`` (``--target pd``: kv_broker, one
   prefill, one decode, the gateway; ``--target unified``: one unified instance instead of the
   pair), with ``--up-args`` after the target's own flags (the tuned GPU flags go there).
2. Warms it up with ``--warmup`` requests at the run's concurrency, then sends
   ``--num-requests`` random prompts of ``--input-len`` tokens, ``--output-len`` new tokens
   each (greedy, EOS ignored), at most ``--concurrency`` in flight, through
   ``dsmesh bench``'s client (dsmesh/bench/serving.py): the undisturbed run.
3. Sends the same load again (fresh prompts of the same lengths, so no prefix cache helps)
   and ``--kill-at`` seconds into it SIGKILLs ``--kill`` (the gateway is excluded: its death
   drops its clients' connections, which no server can carry over). The supervisor restarts
   the process.
4. Waits for the restart, then until no KV page is in use (``--settle-timeout``), and reports:
   requests ok / failed (refused and timed out among them), requests migrated (the gateway's
   ``dsmesh_requests_migrated_total`` over the faulted run; 0 where the gateway has no such
   counter), TTFT and E2E p50 / p99 of both runs and their ratios, the time from the kill
   until the output rate is back (the first ``--window``-second window starting after the
   kill with at least ``--recovered-fraction`` of the undisturbed run's tokens/s), the killed
   process's restart time (SIGKILL to the supervisor's "restarted ... healthy" line), and the
   KV pages in use after (the gateway's ``dsmesh_kv_pages_used`` and each engine instance's).

The table goes to stdout, the figures to ``DIR/faults.json``, the mesh's logs to
``DIR/logs``. Exit status: 0 when measured, 1 when the bench could not run or the
undisturbed run had failures, 2 for bad flags. The figures are in fault_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmesh.bench.backends import Backend, BenchError
from dsmesh.bench.fault_report import (
    Recovery,
    SupervisorLine,
    comparison,
    first_served_after,
    format_table,
    parse_supervisor_line,
    recovery,
    run_figures,
    timeline,
    within,
)
from dsmesh.bench.mesh_metrics import scrape
from dsmesh.bench.mesh_process import Mesh, free_port_run, mesh_up
from dsmesh.bench.serving import (
    BenchConfig,
    BenchRun,
    RequestRecord,
    format_errors,
    make_backend,
    run_benchmark,
    sample_random_requests,
    send_request,
    summarize,
)
from dsmesh.options.fields import add_options, from_args, option

TARGETS = ("pd", "unified")
BACKENDS = ("grpc", "rest", "openai")
# the processes a target runs that may be killed, as ``dsmesh up`` names them
KILLABLE = {
    "pd": re.compile(r"(prefill|decode)-\d+|kv-broker|eplb"),
    "unified": re.compile(r"unified-\d+|kv-broker"),
}
MIGRATED = "dsmesh_requests_migrated_total"
PAGES_USED = "dsmesh_kv_pages_used"


class FaultBenchError(Exception):
    """The benchmark could not measure (the mesh did not start, the kill missed the run)."""


@dataclass(frozen=True)
class FaultBenchConfig:
    """One fault benchmark. Each field is a flag (dsmesh/options/fields.py); :func:`config_from`
    builds it from them."""

    out: Path = option(
        Path("fault-bench"), "the figures (faults.json) and the mesh's logs", parse=Path
    )
    model: str | None = option(None, "checkpoint folder", default_text="the tiny model")
    target: str = option(
        "pd",
        "pd: kv_broker, one prefill, one decode and the gateway; unified: one unified instance "
        "instead of the pair",
        choices=TARGETS,
    )
    device: str | None = option(None, "dsmesh up --device", default_text="its own")
    up_args: str = option(
        "",
        "more dsmesh up flags, after the target's, one quoted string (a single flag: "
        "--up-args=--eplb)",
        metavar="FLAGS",
    )
    backend: str = option("grpc", "the client's API", choices=BACKENDS)
    concurrency: int = option(8, "requests in flight at most")
    num_requests: int = option(64, "requests per run")
    input_len: int = option(128, "prompt tokens")
    output_len: int = option(64, "new tokens, EOS ignored")
    kill: str = option(
        "decode-0",
        "the process to SIGKILL: decode-N, prefill-N, kv-broker (or kv_broker), eplb; "
        "unified-N with --target unified",
    )
    kill_at_s: float = option(2.0, "seconds into the faulted run")
    warmup: int | None = option(None, "untimed requests first", default_text="the concurrency")
    window_s: float = option(1.0, "sliding window of the output rate, seconds")
    recovered_fraction: float = option(0.9, "of the undisturbed output rate")
    settle_timeout_s: float = option(60.0, "after the run: wait this long for 0 pages")
    start_timeout_s: float = option(
        600.0, "for the mesh to start and the killed process to restart"
    )
    request_timeout_s: float = option(600.0, "deadline of each request")
    seed: int = option(0, "prompts (the faulted run's: seed + 1)")
    max_token_id: int = option(500, "prompt token ids below this")

    @property
    def up_flags(self) -> tuple[str, ...]:
        """``up_args`` as words."""
        return tuple(shlex.split(self.up_args))

    def validate(self) -> None:
        """Refuse what cannot be measured, naming the flag."""
        try:
            shlex.split(self.up_args)
        except ValueError as exc:
            raise ValueError(f"--up-args: {exc}: {self.up_args!r}") from None
        if self.target not in TARGETS:
            raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        for flag, value in (
            ("--concurrency", self.concurrency),
            ("--num-requests", self.num_requests),
            ("--input-len", self.input_len),
            ("--output-len", self.output_len),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"--warmup must not be negative, got {self.warmup}")
        if self.max_token_id <= 3:
            raise ValueError(f"--max-token-id must be above 3, got {self.max_token_id}")
        for flag, value in (
            ("--kill-at", self.kill_at_s),
            ("--window", self.window_s),
            ("--settle-timeout", self.settle_timeout_s),
            ("--start-timeout", self.start_timeout_s),
            ("--request-timeout", self.request_timeout_s),
        ):
            if not value > 0 or math.isinf(value):
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        if not 0 < self.recovered_fraction <= 1:
            raise ValueError(
                f"--recovered-fraction must be in (0, 1], got {self.recovered_fraction}"
            )
        if self.kill == "gateway":
            raise ValueError(
                "--kill gateway: the gateway is excluded; its death drops its clients' "
                "connections, which no server can carry over"
            )
        if not KILLABLE[self.target].fullmatch(self.kill):
            raise ValueError(
                f"--kill {self.kill!r} is not a process of a --target {self.target} mesh: "
                f"expected {KILLABLE[self.target].pattern} (dsmesh up's names)"
            )
        if self.target == "unified" and _has_flag(self.up_flags, "--prefill"):
            raise ValueError("--target unified sets --prefill 0 --decode 0: not in --up-args")

    def mesh_args(self) -> list[str]:
        """``dsmesh up``'s flags: the device, the target's, then ``up_args``."""
        args = ["--device", self.device] if self.device is not None else []
        if self.target == "unified":
            args += ["--prefill", "0", "--decode", "0"]
            if not _has_flag(self.up_flags, "--unified"):
                args += ["--unified", "1"]
        return args + list(self.up_flags)


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m dsmesh.bench.faults", description=__doc__.split("\n")[0]
    )
    add_options(ap, FaultBenchConfig)
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> FaultBenchConfig:
    """The flags as a validated config (ValueError names the flag)."""
    kill = "kv-broker" if args.kill == "kv_broker" else args.kill
    config = from_args(FaultBenchConfig, args, kill=kill)
    config.validate()
    return config


class SupervisorWatch:
    """``dsmesh up``'s ready, exit and restart lines as they arrive (fed from the thread that
    reads its output), each with the ``time.monotonic()`` it was read at."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.events: list[tuple[float, SupervisorLine]] = []

    def feed(self, line: str) -> None:
        event = parse_supervisor_line(line)
        if event is not None:
            with self._lock:
                self.events.append((time.monotonic(), event))
                self._lock.notify_all()

    def pids(self) -> dict[str, int]:
        """Each service's serving pid (its latest start)."""
        with self._lock:
            return {e.service: e.pid for _, e in self.events if e.kind in ("ready", "restart")}

    def first_start_s(self, service: str) -> float | None:
        with self._lock:
            return next(
                (e.seconds for _, e in self.events if e.kind == "ready" and e.service == service),
                None,
            )

    def wait_for(
        self, kind: str, service: str, after: float, timeout_s: float
    ) -> tuple[float, SupervisorLine] | None:
        """The first ``(time, event)`` of ``kind`` for ``service`` read after ``after``
        (monotonic), waiting up to ``timeout_s``; None if none came."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                for t, e in self.events:
                    if t >= after and e.kind == kind and e.service == service:
                        return t, e
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(min(remaining, 0.5))


@dataclass
class Kill:
    """The SIGKILL of one process, scheduled in the faulted run's event loop."""

    service: str
    pid: int
    start: float = 0.0  # perf_counter at the faulted run's start
    at_s: float | None = None  # into the run, once sent
    monotonic: float = 0.0

    def send(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.monotonic = time.monotonic()
        self.at_s = time.perf_counter() - self.start


async def _runs(
    config: FaultBenchConfig, mesh: Mesh, kill: Kill, gateway_metrics: str
) -> tuple[BenchRun, BenchRun, dict[str, float], RequestRecord | None]:
    """The undisturbed run, then the faulted one with ``kill`` sent ``kill_at_s`` into it;
    also the gateway's counters just before the faulted run, and the probe that found the
    mesh serving again when no request of the run did after the kill."""
    lengths = ((config.input_len, config.input_len), (config.output_len, config.output_len))
    ids = (3, config.max_token_id)
    undisturbed = sample_random_requests(config.num_requests, *lengths, ids, config.seed)
    faulted = sample_random_requests(config.num_requests, *lengths, ids, config.seed + 1)
    url = gateway_metrics.removesuffix("/metrics")
    warmup = config.warmup if config.warmup is not None else config.concurrency
    bench = BenchConfig(
        backend=config.backend,
        grpc_addr=mesh.grpc_addr,
        url=url,
        max_concurrency=config.concurrency,
        warmup=warmup,
        warmup_concurrency=config.concurrency,
        seed=config.seed,
        request_timeout_s=config.request_timeout_s,
    )
    backend: Backend = make_backend(config.backend, mesh.grpc_addr, url)
    await backend.connect(30.0)
    try:
        first = await run_benchmark(bench, undisturbed, backend=backend)
        _progress("undisturbed", first)
        if config.kill_at_s >= first.duration_s:
            raise FaultBenchError(
                f"--kill-at {config.kill_at_s:g} s is past the end of the undisturbed run "
                f"({first.duration_s:.2f} s): give more --num-requests or an earlier --kill-at"
            )
        before = scrape(gateway_metrics)
        loop = asyncio.get_running_loop()
        kill.start = time.perf_counter()
        timer = loop.call_later(config.kill_at_s, kill.send)
        second = await run_benchmark(dataclasses.replace(bench, warmup=0), faulted, backend=backend)
        timer.cancel()
        _progress("faulted", second)
        if kill.at_s is None:
            raise FaultBenchError(
                f"the faulted run ended ({second.duration_s:.2f} s) before --kill-at "
                f"{config.kill_at_s:g} s: give more --num-requests or an earlier --kill-at"
            )
        probe = None
        if first_served_after(second.records, kill.at_s) is None:
            probe = await _probe(config, backend, kill, (*lengths, ids))
    finally:
        await backend.close()
    return first, second, before, probe


async def _probe(
    config: FaultBenchConfig, backend: Backend, kill: Kill, shape: tuple[Any, ...]
) -> RequestRecord | None:
    """After a faulted run in which no request sent after the kill succeeded: one request of
    the run's shape at a time until one succeeds, for up to ``start_timeout_s``; its record
    (times on the faulted run's clock), or None."""
    deadline = time.monotonic() + config.start_timeout_s
    seed = config.seed + 2
    while time.monotonic() < deadline:
        (request,) = sample_random_requests(1, *shape, seed)
        rec = await send_request(backend, request, -1, kill.start, config.request_timeout_s)
        if rec.success:
            return rec
        seed += 1  # a fresh prompt each time: no prefix cache
        await asyncio.sleep(0.1)
    return None


def _progress(name: str, run: BenchRun) -> None:
    ok = sum(r.success for r in run.records)
    print(f"  {name}: {ok} of {len(run.records)} ok in {run.duration_s:.2f} s", flush=True)


def _pages_used(gateway_metrics: str, instances: dict[str, str]) -> tuple[float, dict[str, float]]:
    """``dsmesh_kv_pages_used`` on the gateway (nan if unreachable) and on each engine
    instance's /metrics (those without the gauge left out: nan)."""
    gateway = scrape(gateway_metrics).get(PAGES_USED, math.nan)
    return gateway, {name: scrape(url).get(PAGES_USED, math.nan) for name, url in instances.items()}


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _settle(
    config: FaultBenchConfig, gateway_metrics: str, instances: dict[str, str]
) -> dict[str, Any]:
    """After the faulted run: wait until the gateway is healthy and no page is in use, up to
    ``settle_timeout_s``; the last reading and how long it took."""
    begin = time.monotonic()
    deadline = begin + config.settle_timeout_s
    base = gateway_metrics.removesuffix("/metrics")
    while True:
        gateway, per_instance = _pages_used(gateway_metrics, instances)
        idle = gateway == 0 and all(v == 0 for v in per_instance.values())
        if (idle and _healthy(base)) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return {
        "kv_pages_used_after": gateway,
        "instance_pages_used_after": per_instance,
        "pages_free_after_s": time.monotonic() - begin if idle else None,
    }


def measure(config: FaultBenchConfig) -> dict[str, Any]:
    """Run the benchmark (see the module's docstring); its figures."""
    up_args = config.mesh_args()
    if not _has_flag(config.up_flags, "--instance-metrics-port"):  # each instance's pages
        up_args += ["--instance-metrics-port", str(free_port_run(16))]
    watch = SupervisorWatch()
    with mesh_up(
        config.model, up_args, config.out / "logs", config.start_timeout_s, on_line=watch.feed
    ) as mesh:
        pids = watch.pids()
        if config.kill not in pids:
            raise ValueError(
                f"--kill {config.kill}: this mesh has no such process "
                f"(it runs {', '.join(sorted(pids))})"
            )
        kill = Kill(config.kill, pids[config.kill])
        undisturbed, faulted, before, probe = asyncio.run(
            _runs(config, mesh, kill, mesh.metrics_url)
        )
        after_run = time.monotonic()
        restarted = watch.wait_for("restart", kill.service, kill.monotonic, config.start_timeout_s)
        exited = watch.wait_for("exit", kill.service, kill.monotonic, 0.0)
        settled = _settle(config, mesh.metrics_url, mesh.instance_metrics)
        after = scrape(mesh.metrics_url)
        waited_s = time.monotonic() - after_run
    u_summary = summarize(undisturbed.records, undisturbed.duration_s)
    f_summary = summarize(faulted.records, faulted.duration_s)
    u, f = run_figures(undisturbed.records, u_summary), run_figures(faulted.records, f_summary)
    rec: Recovery = recovery(
        faulted.records,
        kill.at_s or 0.0,
        faulted.duration_s,
        u["delivered_tok_s"],
        config.window_s,
        config.recovered_fraction,
    )
    restart_s = restarted[0] - kill.monotonic if restarted else None
    bound_ms = 1.5 * u["e2e_ms"]["p99"] + restart_s * 1e3 if restart_s is not None else None
    serving_again_s = first_served_after(faulted.records, kill.at_s or 0.0)
    if probe is not None:
        serving_again_s = first_served_after([probe], kill.at_s or 0.0)
    has_counter = MIGRATED in after or MIGRATED in before
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": _device_name(config.device),
        "config": {**dataclasses.asdict(config), "out": str(config.out)},
        "up_args": up_args,
        "undisturbed": u,
        "faulted": f,
        "ratios": comparison(u, f),
        "migrated": round(after.get(MIGRATED, 0.0) - before.get(MIGRATED, 0.0)),
        "migration_metric": has_counter,
        "kill": {
            "service": kill.service,
            "pid": kill.pid,
            "at_s": kill.at_s,
            "restart_s": restart_s,
            "restart_delay_s": exited[1].seconds if exited else None,
            "restart_healthy": restarted[1].healthy if restarted else None,
            "new_pid": restarted[1].pid if restarted else None,
            "first_start_s": watch.first_start_s(kill.service),
        },
        "recovery": dataclasses.asdict(rec),
        "serving_again_s": serving_again_s,
        "serving_again_probe": probe is not None,
        # output tok/s in consecutive windows of each run, for a plot of the dip
        "timeline_tok_s": {
            "undisturbed": timeline(undisturbed.records, undisturbed.duration_s, config.window_s),
            "faulted": timeline(faulted.records, faulted.duration_s, config.window_s),
        },
        "e2e_p99_bound_ms": bound_ms,
        "e2e_p99_within_bound": within(f["e2e_ms"]["p99"], bound_ms),
        **settled,
        "settle_s": waited_s,
        "errors": format_errors(faulted.records).splitlines(),
    }


def _device_name(device: str | None) -> str:
    if device is None or not device.startswith("cuda"):
        return device or "default"
    import torch

    return torch.cuda.get_device_name(0)


def _finite(value: Any) -> Any:
    """JSON has no nan: unknown figures become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"python -m dsmesh.bench.faults: error: {exc}", file=sys.stderr)
        return 2
    config.out.mkdir(parents=True, exist_ok=True)
    try:
        result = measure(config)
    except ValueError as exc:  # a flag the mesh contradicts (--kill of a process it lacks)
        print(f"python -m dsmesh.bench.faults: error: {exc}", file=sys.stderr)
        return 2
    except (FaultBenchError, BenchError, RuntimeError) as exc:
        print(f"python -m dsmesh.bench.faults: error: {exc}", file=sys.stderr)
        return 1
    path = config.out / "faults.json"
    path.write_text(json.dumps(_finite(result), indent=1) + "\n")
    print(format_table(result), flush=True)
    print(f"figures in {path}", flush=True)
    if result["errors"]:
        print("faulted run, failed requests (first shown):", *result["errors"], sep="\n  ")
    if result["undisturbed"]["failed"]:
        print("the undisturbed run had failures: no reference to compare with", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
