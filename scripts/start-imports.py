"""An engine instance's start-up phases without a mesh (docs/RELIABILITY.md, Restart time):
``imports`` (process start to the engine's build) and, with ``--until``, the phases after it.

Runs ``dsmesh ROLE --model MODEL ...`` RUNS times, one new process each, with the broker
address of nobody (nothing before ready dials it). Each process stops where its start-up
clock takes phase UNTIL (``imports``: where the engine's build starts; ``server``: ready, the
moment its ready line is logged). Prints each run's phases, then their medians, with the CPU
seconds the process had used by then (less sensitive than wall time to a busy machine);
``--modules FILE`` writes the modules the last run had loaded, one a line; ``--importtime
FILE`` adds a run under ``python -X importtime``, writes its report to FILE and prints the
top-level packages that took the most time.

    python scripts/start-imports.py ROLE MODEL [RUNS] [--until PHASE] [--modules FILE]
        [--importtime FILE] [-- FLAGS]
    python scripts/start-imports.py decode /tmp/v2lite 5 --until server -- --dtype bfloat16

ROLE: prefill, decode or unified; FLAGS: the role's own flags. Run it once before timing:
the first start after a change compiles the changed modules' bytecode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# The process: `dsmesh` as its own command (sys.argv, as `python -m dsmesh` runs it), until
# the instance adds phase UNTIL to its clock.
_STOP_AT = """
import json, os, sys, time
from dsmesh.engine import startup

until, sys.argv = sys.argv[1], ["dsmesh", *sys.argv[2:]]
add = startup.StartupClock.add

def stop(clock, name, seconds):
    add(clock, name, seconds)
    if name == until:
        out = os.environ.get("START_IMPORTS_MODULES")
        if out:
            with open(out, "w") as f:
                f.write("\\n".join(sorted(sys.modules)) + "\\n")
        print("PHASES " + json.dumps({**clock.phases, "cpu": time.process_time()}), flush=True)
        os._exit(0)

startup.StartupClock.add = stop
from dsmesh.cli.main import main
sys.exit(main())
"""


def one_start(
    args: argparse.Namespace, flags: list[str], python: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    argv = [args.role, "--model", args.model, "--broker", "127.0.0.1:1", "--port", "0"]
    env = {**os.environ, "START_IMPORTS_MODULES": args.modules} if args.modules else None
    return subprocess.run(
        [sys.executable, *python, "-c", _STOP_AT, args.until, *argv, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def phases_of(proc: subprocess.CompletedProcess[str], args: argparse.Namespace) -> dict[str, float]:
    for line in proc.stdout.splitlines():
        if line.startswith("PHASES "):
            return json.loads(line.removeprefix("PHASES "))
    raise SystemExit(f"{args.role} did not reach phase {args.until}:\n{proc.stderr[-3000:]}")


def top_packages(report: str, count: int = 12) -> list[tuple[float, str]]:
    """``-X importtime``'s report summed by top-level package: (seconds of its own, name)."""
    own: dict[str, float] = {}
    for line in report.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.removeprefix("import time:").split("|")
        package = name.strip().split(".")[0]
        own[package] = own.get(package, 0.0) + int(self_us) / 1e6
    return sorted(((s, p) for p, s in own.items()), reverse=True)[:count]


def main() -> None:
    argv = sys.argv[1:]
    flags: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, flags = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("prefill", "decode", "unified"))
    parser.add_argument("model")
    parser.add_argument("runs", type=int, nargs="?", default=5)
    parser.add_argument("--until", default="imports", help="the phase to stop at")
    parser.add_argument("--modules", metavar="FILE", help="write the loaded modules here")
    parser.add_argument("--importtime", metavar="FILE", help="write -X importtime's report here")
    args = parser.parse_args(argv)
    runs = [phases_of(one_start(args, flags), args) for _ in range(args.runs)]
    for run in runs:
        print(f"{args.role}: " + ", ".join(f"{k} {v:.3f}" for k, v in run.items()))
    medians = {k: statistics.median(run.get(k, 0.0) for run in runs) for k in runs[0]}
    total = statistics.median(sum(v for k, v in run.items() if k != "cpu") for run in runs)
    print(
        f"{args.role} median of {len(runs)}: total {total:.3f} s; "
        + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
    )

    if args.importtime:
        proc = one_start(args, flags, ("-X", "importtime"))
        phases_of(proc, args)
        with open(args.importtime, "w") as f:
            f.write(proc.stderr)
        print(
            "own import seconds by package: "
            + ", ".join(f"{p} {s:.3f}" for s, p in top_packages(proc.stderr))
        )


if __name__ == "__main__":
    main()
