"""Step ``fp8_linear`` of the kernel micro-benchmarks (dsmesh/bench/kernels.py).

    python3 -m dsmesh.bench.kernels --only fp8_linear [--quick] --out fp8_linear.json

DeepSeek-V3's dense linears (q_a + kv_a fused, q_b, o_proj, the shared experts' gate + up
and down) at decode and prefill row counts: the bf16 GEMM the engine ran before
2026-12-06 (the reference column), then the block-scaled FP8 linear through dsmesh's Triton
GEMM and through DeepGEMM (when installed), each including the activation quantisation, all
timed in CUDA graphs. ``speedup`` is bf16's time over the FP8 backend's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name, N, K: V3's FP8 linears as the engine runs them (fused where it fuses)
V3_LINEARS = (
    ("q_a+kv_a", 2112, 7168),
    ("q_b", 24576, 1536),
    ("o_proj", 7168, 16384),
    ("shared gate+up", 4096, 7168),
    ("shared down", 7168, 2048),
)
ROWS = (1, 64, 256, 2048, 16000)


def fp8_linear_bench(quick: bool) -> None:
    from dsmesh.kernels.backends import available

    backends = ["triton"] + (["deep_gemm"] if available("deep_gemm") else [])
    for name, n, k in V3_LINEARS:
        _one_shape(name, n, k, ROWS[1::2] if quick else ROWS, backends)
        torch.cuda.empty_cache()


def _one_shape(name: str, n: int, k: int, rows: tuple[int, ...], backends: list[str]) -> None:
    from dsmesh.bench.kernel_timing import bench_graph, record
    from dsmesh.kernels.fp8 import quantize_fp8_block
    from dsmesh.kernels.fp8_linear import fp8_linear

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, scale_inv = quantize_fp8_block(w)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref_ms = bench_graph(lambda x=x: F.linear(x, w), calls=5)
        want = F.linear(x, w).float()
        for backend in backends:

            def run(x=x, backend=backend):
                return fp8_linear(x, q, scale_inv, backend)

            err = float((run().float() - want).norm() / want.norm())
            ms = bench_graph(run, calls=5)
            if ms is None or ref_ms is None:
                continue
            record(
                f"fp8_linear_{backend}",
                f"{name} M={m} N={n} K={k}",
                ms,
                ref_ms,
                tflops=round(2 * m * n * k / ms / 1e9, 1),
                weight_gbs=round((n * k) / ms / 1e6, 1),
                rel_err_vs_bf16=round(err, 4),
            )
