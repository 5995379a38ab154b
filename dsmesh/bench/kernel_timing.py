"""Timing and recording of one kernel benchmark row (dsmesh/bench/kernels.py and the
per-kernel benches beside it): medians from Triton's ``do_bench``, CUDA-graph timing, and the
rows every run appends to :data:`RESULTS`."""

from __future__ import annotations

import json

import torch

RESULTS: list[dict] = []


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn, calls: int = 20) -> float | None:
    """Median milliseconds per call with ``calls`` calls captured in one CUDA graph: the GPU
    time without Python launch overhead (what a captured decode step pays)."""
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return round(bench(graph.replay) / calls, 4)
    except Exception as exc:
        print(f"  graph capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def record(name: str, shape: str, ms: float, ref_ms: float | None, **extra) -> None:
    row = {"kernel": name, "shape": shape, "ms": round(ms, 4)}
    if ref_ms is not None:
        row["ref_ms"] = round(ref_ms, 4)
        row["speedup"] = round(ref_ms / ms, 2)
    row.update(extra)
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
