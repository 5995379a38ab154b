# ruff: noqa: B023 - every lambda here is timed inside the loop iteration that defines it
"""Micro-benchmarks of the kernels against their torch references on one CUDA GPU.

    python3 -m dsmesh.bench.kernels [--out results.json] [--quick]
    python3 -m dsmesh.bench.kernels --only mla_decode --mla-heads 16,128 \
        --batches 1,32,128,256 --contexts 2048,32768 [--mla-fp8] --out mla.json

Each row: the kernel's median time (``triton.testing.do_bench``), the torch reference's (or
the engine's previous torch path), the speed-up, and achieved GB/s or TFLOP/s from the bytes /
operations the shape needs. Block-size variants are timed too, and the best is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from dsmesh.bench.kernel_timing import RESULTS, bench, bench_graph, record
from dsmesh.bench.kernels_fp8_linear import fp8_linear_bench

# fused MoE block sizes found by --tune (dsmesh.kernels.moe_fused format)
TUNED: dict[str, dict] = {}
TUNE = False
STEPS = (
    "mla_decode",
    "mla_prefill",
    "quant",
    "routing",
    "moe",
    "moe_fp8_crossover",
    "moe_fused",
    "fp8_linear",
    "scaled_grouped_mm",
)


def best_variant(run, variants: list[dict], graph: bool = False) -> tuple[float, dict]:
    """Fastest of ``variants`` (``run(variant)`` per call); ``graph`` times calls captured in a
    CUDA graph, which small problems need (their eager time is the launch overhead)."""
    best = (math.nan, {})
    if not variants:
        return best
    best = (math.inf, {})
    for v in variants:
        try:
            if graph:
                ms = bench_graph(lambda v=v: run(v), calls=10)
                if ms is None:
                    continue
            else:
                ms = bench(lambda v=v: run(v), warmup=10, rep=40)
        except Exception as exc:  # a variant that does not compile (shared memory) is skipped
            print(f"  variant {v} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"  variant {v}: {ms:.4f} ms")
        best = min(best, (ms, v), key=lambda x: x[0])
    return best


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    gbs = 2 * x.numel() * 2 / ms / 1e6
    record("copy", "2 GiB d2d", ms, None, gbs=round(gbs, 1))
    return gbs


def mla_decode_bench(
    heads: list[int], batches: list[int], contexts: list[int], page: int, fp8: bool,
    flashinfer_backends: list[str],
) -> None:  # fmt: skip
    """MLA decode per layer (DeepSeek's latent 512 + rope 64, bf16), graph-timed, for every
    (heads, context, batch): dsmesh's kernel as the shapes choose it; at 64 heads or more also
    the 16-head-block kernel alone (``triton_narrow``: dsmesh's only kernel before 2026-12-04);
    with ``fp8`` the same call over the FP8 cache; FlashInfer when installed. FLOPs count
    2 * B * H * L * (576 + 512); bytes the cache read once."""
    for h in heads:
        for ctx in contexts:
            for b in batches:
                mla_decode_case(h, b, ctx, page, fp8, flashinfer_backends)
                torch.cuda.empty_cache()


def mla_decode_case(
    h: int, b: int, ctx: int, page: int, fp8: bool, flashinfer_backends: list[str]
) -> None:
    from dsmesh.kernels.mla_decode import (
        fp8_kv_pages,
        mla_decode,
        mla_decode_ref,
        uses_wide_kernel,
    )

    c, r = 512, 64
    pages_per = math.ceil(ctx / page)
    kv = torch.randn(b * pages_per + 8, page, c + r, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(b * pages_per, device="cuda").view(b, pages_per).int()
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(b, h, c, device="cuda", dtype=torch.bfloat16)
    qpe = torch.randn(b, h, r, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(192)
    args = (q, qpe, kv, pt, lens, scale)
    flops = 2 * b * h * ctx * (c + r + c)
    kv_bytes = b * ctx * (c + r) * 2
    # calls per graph: about 2 ms of work at 100 TFLOP/s or 3 TB/s, 1 to 20
    est_ms = max(flops / 100e9, kv_bytes / 3e9)
    calls = max(1, min(20, round(2 / est_ms)))
    n = min(b, 2)  # error against the reference on the first requests (its memory is B*H*L)
    sub = (q[:n], qpe[:n], kv, pt[:n], lens[:n], scale)
    ref = mla_decode_ref(*sub).float()

    def timed(fn, sub_fn, want=ref, nbytes=kv_bytes) -> dict:
        try:
            ms = bench_graph(fn, calls=calls)
            err = float((sub_fn().float() - want).norm() / want.norm())
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if ms is None:
            return {"error": "graph capture failed"}
        return {
            "ms": ms,
            "tflops": round(flops / ms / 1e9, 1),
            "gbs": round(nbytes / ms / 1e6, 1),
            "rel_err": round(err, 5),
        }

    row = timed(lambda: mla_decode(*args), lambda: mla_decode(*sub))
    row["kernel_choice"] = "wide" if uses_wide_kernel(h, c, r, q.dtype) else "narrow"
    if h >= 64:
        narrow = {"kernel": "narrow"}
        row["triton_narrow"] = timed(
            lambda: mla_decode(*args, config=narrow), lambda: mla_decode(*sub, config=narrow)
        )
    if fp8:
        kv8, scales = fp8_kv_pages(kv, c)
        a8 = (q, qpe, kv8, pt, lens, scale)
        s8 = (q[:n], qpe[:n], kv8, pt[:n], lens[:n], scale)
        ref8 = mla_decode_ref(*s8, kv_scales=scales).float()
        row["triton_fp8"] = timed(
            lambda: mla_decode(*a8, kv_scales=scales),
            lambda: mla_decode(*s8, kv_scales=scales),
            want=ref8,
            nbytes=b * ctx * (c + r + 8),
        )
        del kv8, scales
    row.update(flashinfer_mla_rows(args, page, flashinfer_backends, timed))
    if TUNE:  # block sizes and splits of the kernel the shapes choose
        ms, cfg = best_variant(
            lambda v: mla_decode(*args, num_splits=v.get("splits"), config=v.get("config")),
            mla_variants(h, b, row["kernel_choice"] == "wide"),
            graph=True,
        )
        row["best"] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), **cfg}
    ms = row.pop("ms", math.nan)
    record("mla_decode", f"B={b} H={h} ctx={ctx} page={page} bf16", ms, None, **row)


def mla_variants(h: int, b: int, wide: bool) -> list[dict]:
    """--tune's candidates for :func:`mla_decode_case`: tiles x split counts."""
    if wide:
        tiles = [(16, 8, 4), (32, 8, 3), (32, 8, 5), (64, 8, 1), (64, 8, 2)]
        splits = {1: (8, 16, 32, 64), 32: (1, 2, 4)}.get(b, (None,))
    elif h <= 16:  # V2-Lite: tile length, pipeline depth, splits
        tiles = [(16, 4, 5), (32, 4, 4), (32, 4, 5), (32, 4, 6), (64, 8, 3)]
        splits = {32: (4, 7, 12), 128: (1, 2, 3), 256: (1, 2)}.get(b, (None,))
    else:
        return []
    return [
        {"config": {"block_n": bn, "num_warps": w, "num_stages": st}, "splits": sp}
        for bn, w, st in tiles
        for sp in splits
    ]


def flashinfer_mla_rows(args: tuple, page: int, backends: list[str], timed) -> dict:
    """FlashInfer's MLA decode on the same problem, per backend (fa2, fa3), through ``timed``
    (graph-timed ms, TFLOP/s, GB/s, error); empty when FlashInfer is not installed."""
    from dsmesh.kernels.backends import available

    if not backends or not available("flashinfer"):
        return {}
    from dsmesh.kernels.mla_decode_flashinfer import FlashInferMLADecode

    q, qpe, kv, pt, lens, scale = args
    n = min(q.shape[0], 2)
    rows: dict = {}
    shape = (q.shape[1], q.shape[2], qpe.shape[2], page, q.dtype, scale, pt.shape[1])
    for backend in backends:
        try:
            fis = [
                FlashInferMLADecode(q.device, *shape, graph=True, backend=backend) for _ in range(2)
            ]
            fis[0].plan(pt.cpu().numpy(), lens.cpu().numpy())
            fis[1].plan(pt[:n].cpu().numpy(), lens[:n].cpu().numpy())
            sub = (q[:n], qpe[:n], kv, pt[:n], lens[:n], scale)
            rows[f"flashinfer_{backend}"] = timed(lambda: fis[0](*args), lambda: fis[1](*sub))
        except Exception as exc:
            rows[f"flashinfer_{backend}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return rows


def mla_prefill_bench(quick: bool) -> None:
    from dsmesh.kernels.mla_prefill import mla_prefill, mla_prefill_ref

    d, rr, dv = 128, 64, 128
    cases = [(16, [2000]), (16, [2000] * 8), (128, [2000]), (16, [500] * 4)]
    if quick:
        cases = cases[:2]
    for h, lens in cases:
        prefixes = [0] * (len(lens) - 1) + [0] if h != 16 or len(lens) != 4 else [1500] * 4
        t = sum(lens)
        s = sum(a + p for a, p in zip(lens, prefixes, strict=True))
        qn = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
        qp = torch.randn(t, h, rr, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(s, rr, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(s, h, dv, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.tensor([0, *lens], device="cuda").cumsum(0).int()
        cu_k = (
            torch.tensor([0, *[a + p for a, p in zip(lens, prefixes, strict=True)]], device="cuda")
            .cumsum(0)
            .int()
        )
        args = (qn, qp, kn, kp, v, cu_q, cu_k, 0.1)
        ms = bench(lambda: mla_prefill(*args, max(lens)))
        ref = bench(lambda: mla_prefill_ref(*args), warmup=3, rep=20)

        def sdpa():  # torch's fused attention on the same problem (heads concatenated)
            outs = []
            for i, (a, p) in enumerate(zip(lens, prefixes, strict=True)):
                q0, q1, k0 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
                q = torch.cat([qn[q0:q1], qp[q0:q1]], -1).transpose(0, 1)[None]
                kk = torch.cat(
                    [kn[k0 : k0 + a + p], kp[k0 : k0 + a + p, None].expand(-1, h, -1)], -1
                )
                mask = None
                if p:
                    qpos = torch.arange(a, device="cuda")[:, None] + p
                    mask = torch.arange(a + p, device="cuda")[None] <= qpos
                outs.append(
                    F.scaled_dot_product_attention(
                        q,
                        kk.transpose(0, 1)[None],
                        v[k0 : k0 + a + p].transpose(0, 1)[None],
                        attn_mask=mask,
                        is_causal=not p,
                        scale=0.1,
                    )
                )
            return outs

        sdpa_ms = bench(sdpa)
        variants = [
            {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
            for bm in (64, 128)
            for bn in (32, 64)
            for w in (4, 8)
            for st in (2, 3)
        ]
        if quick or not TUNE or len(lens) > 1:
            variants = []
        best_ms, best_cfg = best_variant(
            lambda cfg: mla_prefill(*args, max(lens), config=cfg), variants
        )
        flops = sum(
            2 * h * a * (p + (a + 1) / 2) * (d + rr + dv)
            for a, p in zip(lens, prefixes, strict=True)
        )
        err = (mla_prefill(*args, max(lens)).float() - mla_prefill_ref(*args).float()).norm()
        err = err / mla_prefill_ref(*args).float().norm()
        record(
            "mla_prefill",
            f"H={h} q_lens={lens[0]}x{len(lens)} prefix={prefixes[0]} bf16",
            ms,
            ref,
            sdpa_ms=round(sdpa_ms, 4),
            tflops=round(flops / ms / 1e9, 1),
            best_ms=round(best_ms, 4),
            best_tflops=round(flops / best_ms / 1e9, 1),
            best_config=best_cfg,
            rel_err=float(err),
        )


def quant_bench() -> None:
    from dsmesh.kernels.fp8_quant import (
        per_token_group_quant_fp8,
        per_token_group_quant_fp8_ref,
        silu_mul_quant_fp8,
        silu_mul_quant_fp8_ref,
    )

    x = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: per_token_group_quant_fp8(x))
    ref = bench(lambda: per_token_group_quant_fp8_ref(x))
    nbytes = x.numel() * 3 + x.numel() // 128 * 4
    record("fp8_quant", "8192x7168 bf16", ms, ref, gbs=round(nbytes / ms / 1e6, 1))
    xs = x[:128]
    record(
        "fp8_quant",
        "128x7168 bf16 (graph)",
        bench_graph(lambda: per_token_group_quant_fp8(xs)),
        bench_graph(lambda: per_token_group_quant_fp8_ref(xs)),
    )
    gu = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: silu_mul_quant_fp8(gu))
    ref = bench(lambda: silu_mul_quant_fp8_ref(gu))
    nbytes = gu.numel() * 2 + gu.numel() // 2
    record("silu_mul_quant_fp8", "8192x(2x2048) bf16", ms, ref, gbs=round(nbytes / ms / 1e6, 1))


def routing_bench() -> None:
    from dsmesh.kernels.moe_routing import fused_select_experts, select_experts_ref
    from tests.kernels.test_moe_routing import CONFIGS

    for name in ("v3", "v2_lite_greedy"):
        cfg = CONFIGS[name]
        for t in (128, 8192):
            logits = torch.randn(t, cfg.n_routed_experts, device="cuda")
            bias = torch.randn(cfg.n_routed_experts, device="cuda") * 0.1
            bias = bias if cfg.topk_method == "noaux_tc" else None
            ms = bench(lambda: fused_select_experts(logits, cfg, bias))
            ref = bench(lambda: select_experts_ref(logits, cfg, bias))
            record(
                "routing",
                f"{name} T={t}",
                ms,
                ref,
                graph_ms=bench_graph(lambda: fused_select_experts(logits, cfg, bias)),
                ref_graph_ms=bench_graph(lambda: select_experts_ref(logits, cfg, bias)),
            )


def moe_bench(quick: bool) -> None:
    from dsmesh.kernels.fp8 import Fp8ExpertWeights
    from dsmesh.kernels.moe_gemm import (
        expert_ffn,
        expert_ffn_fp8,
        expert_ffn_ref,
        fp8_expert_backend,
        fp8_grouped_gemm,
        permute_tokens,
    )

    shapes = [("v3", 256, 7168, 2048, 8), ("v2_lite", 64, 2048, 1408, 6)]
    for name, e, hdim, inter, k in shapes:
        w13 = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        fp8 = Fp8ExpertWeights.from_dense(w13, w2) if hdim % 128 == 0 and inter % 128 == 0 else None
        for t in (128, 4096) if not quick else (4096,):
            x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
            rows, counts, _ = permute_tokens(x, ids, e)
            flops = 2 * rows.shape[0] * 3 * inter * hdim
            touched = int((counts > 0).sum())
            wbytes = touched * 3 * inter * hdim
            ms_bf16 = bench(lambda: expert_ffn(rows, counts, w13, w2))
            ref = bench(lambda: expert_ffn_ref(rows, counts, w13, w2), warmup=3, rep=20)
            record(
                "moe_bf16_grouped_mm",
                f"{name} T={t} top{k} E={e}",
                ms_bf16,
                ref,
                graph_ms=bench_graph(lambda: expert_ffn(rows, counts, w13, w2), calls=5),
                tflops=round(flops / ms_bf16 / 1e9, 1),
                weight_gbs=round(2 * wbytes / ms_bf16 / 1e6, 1),
            )
            if fp8 is None:
                continue
            ms = bench(lambda: expert_ffn_fp8(rows, counts, fp8))
            out = expert_ffn_fp8(rows, counts, fp8).float()
            dense = expert_ffn(rows, counts, w13, w2).float()
            err = float((out - dense).norm() / dense.norm())
            from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8

            a, a_s = per_token_group_quant_fp8(rows)
            variants = [
                {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s}
                for bm in (16, 64, 128)
                for bn in (64, 128)
                for w in (4, 8)
                for s in (3, 4)
            ]
            if t < 1024:
                variants = [v for v in variants if v["block_m"] <= 64]
            if quick or not TUNE or name != "v3":
                variants = []
            best_ms, best_cfg = best_variant(
                lambda v: fp8_grouped_gemm(a, a_s, fp8.w13, fp8.w13_scale, counts, config=v),
                variants,
            )
            gemm_ms = bench(lambda: fp8_grouped_gemm(a, a_s, fp8.w13, fp8.w13_scale, counts))
            record(
                f"moe_fp8_{fp8_expert_backend(rows, fp8)}",
                f"{name} T={t} top{k} E={e}",
                ms,
                ms_bf16,
                graph_ms=bench_graph(lambda: expert_ffn_fp8(rows, counts, fp8), calls=5),
                tflops=round(flops / ms / 1e9, 1),
                weight_gbs=round(wbytes / ms / 1e6, 1),
                rel_err_vs_bf16=err,
                w13_gemm_ms=round(gemm_ms, 4),
                w13_best_ms=round(best_ms, 4),
                w13_best_config=best_cfg,
            )
        torch.cuda.empty_cache()


def moe_fp8_crossover(quick: bool) -> None:
    """FP8 experts (quantise, gate/up GEMM, silu*up + quantise, down GEMM) through DeepGEMM
    against dsmesh's Triton kernels, from decode-sized to prefill-sized problems: where
    ``prefers_deep_gemm`` should switch. Both are timed in CUDA graphs (no launch overhead on
    either side); ``speedup`` is Triton's time over DeepGEMM's."""
    from dsmesh.kernels.backends import available

    if not available("deep_gemm"):
        print("moe_fp8_crossover: deep_gemm is not installed; skipped", flush=True)
        return
    from dsmesh.kernels.fp8 import Fp8ExpertWeights
    from dsmesh.kernels.moe_gemm import expert_ffn_fp8, fp8_expert_backend, permute_tokens

    shapes = [
        ("v3", 256, 7168, 2048, 8, (256, 1024, 2048, 4096, 8192, 16384)),
        ("v2_lite", 64, 2048, 1408, 6, (256, 1024, 2048, 4096, 16384)),
    ]
    for name, e, hdim, inter, k, sizes in shapes:
        fp8 = Fp8ExpertWeights.from_dense(
            torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * 0.02,
            torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * 0.02,
        )
        torch.cuda.empty_cache()
        for t in sizes[1::2] if quick else sizes:
            x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
            rows, counts, _ = permute_tokens(x, ids, e)
            m = rows.shape[0]

            def run(backend: str):
                return lambda: expert_ffn_fp8(rows, counts, fp8, backend=backend)

            want = run("triton")().float()
            err = float((run("deep_gemm")().float() - want).norm() / want.norm())
            ms_triton = bench_graph(run("triton"), calls=3)
            ms_dg = bench_graph(run("deep_gemm"), calls=3)
            if ms_triton is None or ms_dg is None:
                continue
            flops = 2 * m * 3 * inter * hdim
            record(
                "moe_fp8_crossover",
                f"{name} T={t} rows/expert={m / e:.1f}",
                ms_dg,
                ms_triton,
                deepgemm_tflops=round(flops / ms_dg / 1e9, 1),
                triton_tflops=round(flops / ms_triton / 1e9, 1),
                rel_err_vs_triton=err,
                uses=fp8_expert_backend(rows, fp8),
            )
        torch.cuda.empty_cache()


def _grouped_routed(x, ids, weights, w13, w2):
    """The grouped-GEMM routed-expert path (``moe_backend="grouped"``): LocalDispatcher's
    sort and gather, two ``torch._grouped_mm`` with SwiGLU between, the weighted combine."""
    from dsmesh.engine.model.moe import RoutedExperts
    from dsmesh.engine.model.moe_dispatch import LocalDispatcher

    experts = RoutedExperts(w13.shape[0], w13.shape[2], w2.shape[2])
    experts.w13 = torch.nn.Parameter(w13, requires_grad=False)
    experts.w2 = torch.nn.Parameter(w2, requires_grad=False)
    dispatcher = LocalDispatcher(w13.shape[0])
    out = dispatcher.dispatch(x, ids, weights)
    assert out.tokens_per_expert is not None
    return dispatcher.combine(experts(out.hidden, out.tokens_per_expert), out)


def fused_moe_bench(quick: bool) -> None:
    """Decode-sized routed experts, bf16: fused kernels vs the grouped-GEMM path, in graphs."""
    from dsmesh.kernels.moe_fused import fused_moe

    shapes = [("v2_lite", 64, 2048, 1408, 6), ("v3", 256, 7168, 2048, 8)]
    for name, e, hdim, inter, k in shapes:
        w13 = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        for t in (1, 32, 128, 256) if not quick else (256,):
            x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
            weights = torch.rand(t, k, device="cuda")
            touched = int(torch.unique(ids).numel())
            wbytes = touched * 3 * inter * hdim * 2
            fused_ms = bench_graph(lambda: fused_moe(x, w13, w2, ids, weights), calls=5)
            ref_ms = bench_graph(lambda: _grouped_routed(x, ids, weights, w13, w2), calls=5)
            out = fused_moe(x, w13, w2, ids, weights).float()
            ref = _grouped_routed(x, ids, weights, w13, w2).float()
            err = float((out - ref).norm() / ref.norm())
            best = {}
            if TUNE and not quick and t == 256 and name == "v2_lite":
                best = _tune_fused_moe(x, w13, w2, ids, weights, wbytes)
            record(
                "moe_fused_decode",
                f"{name} T={t} top{k} E={e} bf16 (graph)",
                fused_ms or math.nan,
                ref_ms,
                weight_gbs=round(wbytes / fused_ms / 1e6, 1) if fused_ms else None,
                grouped_weight_gbs=round(wbytes / ref_ms / 1e6, 1) if ref_ms else None,
                experts_touched=touched,
                rel_err_vs_grouped=err,
                **best,
            )
        torch.cuda.empty_cache()


def _tune_fused_moe(x, w13, w2, ids, weights, wbytes) -> dict:
    """Block sizes of each fused GEMM (the other at its default), timed in graphs."""
    from dsmesh.kernels.moe_fused import fused_moe

    space = [
        {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st}
        for bm in (16, 32)
        for bn in (32, 64, 128)
        for bk in (64, 128, 256)
        for w, st in ((4, 3), (4, 5), (8, 4))
        if not (w == 8 and bn == 32)
    ]
    found = {}
    for which in ("gate_up_config", "down_config"):
        best = (math.inf, {})
        print(f"  tuning {which}: {len(space)} variants", flush=True)
        for v in space:
            ms = bench_graph(lambda v=v: fused_moe(x, w13, w2, ids, weights, **{which: v}), 5)
            if ms is not None and ms < best[0]:
                best = (ms, v)
        print(f"  best {which}: {best}", flush=True)
        found[f"best_{which}"] = best[1]
        found[f"best_{which}_ms"] = best[0]
    both = {k.removeprefix("best_"): v for k, v in found.items() if not k.endswith("_ms")}
    ms = bench_graph(lambda: fused_moe(x, w13, w2, ids, weights, **both), 5)
    TUNED["gate_up"] = both["gate_up_config"]
    TUNED["down"] = both["down_config"]
    found["best_both_ms"] = ms
    found["best_both_weight_gbs"] = round(wbytes / ms / 1e6, 1) if ms else None
    return found


def scaled_grouped_mm_probe() -> None:
    """Does torch._scaled_grouped_mm take 1x128 / 128x128 block scales on this GPU?"""
    e, m, n, k = 4, 256, 256, 512
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(e, n, k, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
    offs = torch.tensor([64, 128, 192, 256], device="cuda", dtype=torch.int32)
    tries = {
        "rowwise": (torch.ones(m, device="cuda"), torch.ones(e, n, device="cuda")),
        "block": (
            torch.ones(m, k // 128, device="cuda"),
            torch.ones(e, n // 128, k // 128, device="cuda"),
        ),
    }
    for label, (sa, sb) in tries.items():
        try:
            torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
            result = "runs"
        except Exception as exc:
            result = f"{type(exc).__name__}: {str(exc)[:200]}"
        RESULTS.append({"kernel": "_scaled_grouped_mm probe", "shape": label, "result": result})
        print(label, result, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also time block-size variants")
    parser.add_argument(
        "--tuned-out",
        default=None,
        help="write the fused MoE block sizes --tune found (for $DSMESH_MOE_FUSED_CONFIG)",
    )
    parser.add_argument(
        "--only", default="", help="comma list of steps to run (default all): " + ",".join(STEPS)
    )
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    mla = parser.add_argument_group("mla_decode (comma lists)")
    mla.add_argument("--mla-heads", type=ints, default=[16, 128], help="head counts")
    mla.add_argument("--batches", type=ints, default=[1, 32, 128, 256], help="batch sizes")
    mla.add_argument("--contexts", type=ints, default=[2000], help="tokens per request")
    mla.add_argument("--mla-page", type=int, default=16, help="page size")
    mla.add_argument("--mla-fp8", action="store_true", help="time the FP8 cache too")
    mla.add_argument("--flashinfer-backends", default="fa3", help="fa2, fa3 or none (empty)")
    args = parser.parse_args()
    global TUNE
    TUNE = args.tune
    torch.manual_seed(0)
    start = time.time()
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(info)
    copy_bandwidth()
    steps = {
        "mla_decode": lambda: mla_decode_bench(
            args.mla_heads,
            [128] if args.quick else args.batches,
            args.contexts,
            args.mla_page,
            args.mla_fp8,
            [x for x in args.flashinfer_backends.split(",") if x],
        ),
        "mla_prefill": lambda: mla_prefill_bench(args.quick),
        "quant": quant_bench,
        "routing": routing_bench,
        "moe": lambda: moe_bench(args.quick),
        "moe_fp8_crossover": lambda: moe_fp8_crossover(args.quick),
        "moe_fused": lambda: fused_moe_bench(args.quick),
        "fp8_linear": lambda: fp8_linear_bench(args.quick),
        "scaled_grouped_mm": scaled_grouped_mm_probe,
    }
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(steps))
    if unknown:
        parser.error(f"--only: unknown steps {unknown}; choose from {sorted(steps)}")
    for name, step in steps.items():
        if only and name not in only:
            continue
        try:
            step()
        except Exception as exc:  # keep the other kernels' numbers
            print(f"bench step failed: {type(exc).__name__}: {exc}", flush=True)
            RESULTS.append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"info": info, "results": RESULTS}, f, indent=1)
    if args.tuned_out and TUNED:
        with open(args.tuned_out, "w") as f:
            json.dump(TUNED, f, indent=1)
    print(f"total {time.time() - start:.0f} s")
    for row in RESULTS:
        print(
            f"{row.get('kernel', '-'):22} {row.get('shape', ''):40} {row.get('ms', '')!s:>8} "
            f"{row.get('ref_ms', '')!s:>9} x{row.get('speedup', '')!s:<6} "
            f"{row.get('gbs', row.get('tflops', ''))!s:>7} graph {row.get('graph_ms', '')} "
            f"ref_graph {row.get('ref_graph_ms', '')}"
        )


if __name__ == "__main__":
    main()
