"""Two processes on one GPU: how much of each one's speed alone they keep when they run
together, in the driver's time slices and under an MPS daemon (dsmesh/runtime/gpu_sharing.py).

    python -m dsmesh.bench.gpu_sharing [--seconds 3]

One process runs bf16 8192 x 8192 matmuls (compute-bound, as prefill), the other copies
2 GiB buffers (memory-bound, as decode); each counts its iterations for ``--seconds``. Both
start on the same wall-clock second. Prints iterations per second alone, together in time
slices, together under MPS, and the sum of the two shares (1.0: no gain from sharing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("matmul", "copy")


def worker(kind: str, seconds: float, start_at: float) -> None:
    import torch

    torch.cuda.set_device(0)
    if kind == "matmul":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

        def step() -> None:
            a @ a
    else:
        src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def step() -> None:
            dst.copy_(src)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        n += 4
    print(json.dumps({kind: n / (time.perf_counter() - t0)}), flush=True)


def run(kinds: tuple[str, ...], seconds: float, env: dict[str, str]) -> dict[str, float]:
    start_at = time.time() + 10.0  # after every process has warmed up
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsmesh.bench.gpu_sharing",
                "--worker",
                k,
                "--seconds",
                str(seconds),
                "--start-at",
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for k in kinds
    ]
    out: dict[str, float] = {}
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"worker exited with {p.returncode}")
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    from dsmesh.runtime.gpu_sharing import CONTROL, MpsDaemon

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seconds, args.start_at)
        return {}
    alone = {k: run((k,), args.seconds, {})[k] for k in KINDS}
    results: dict[str, object] = {"alone": alone}
    results["time_slices"] = run(KINDS, args.seconds, {})
    control = shutil.which(CONTROL)
    if control is None:
        print(f"{CONTROL} not on the PATH: no MPS run", file=sys.stderr)
    else:
        daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="mps-log-")), (), control)
        daemon.start()
        try:
            results["mps"] = run(KINDS, args.seconds, daemon.env())
        finally:
            daemon.stop()
    for mode in ("time_slices", "mps"):
        got = results.get(mode)
        if isinstance(got, dict):
            shares = {k: got[k] / alone[k] for k in KINDS}
            results[f"{mode}_shares"] = shares
            results[f"{mode}_sum"] = sum(shares.values())
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
