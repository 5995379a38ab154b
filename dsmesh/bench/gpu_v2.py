"""Part ``v2`` of the GPU benchmark (dsmesh/bench/gpu.py): DeepSeek-V2-Lite's shape with random
weights. Prefill tokens/s and FLOP rate against the matmul ceiling; decode tokens/s at each
batch, with and without CUDA graphs, against the HBM roofline; in the same run the baselines
of the largest batch (no overlapped decode, the grouped-GEMM MoE path, the other MLA decode
kernel) and, with ``--profile``, the kernel tables."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsmesh.bench.engine_steps import (
    bench_decode,
    bench_other_attention,
    bench_prefill,
    graph_replay_seconds,
    make_engine,
)
from dsmesh.bench.random_model import build_dsmesh, v2_lite_config
from dsmesh.bench.roofline import kv_bytes, pool_token_bytes, prefill_flops, weight_bytes_touched
from dsmesh.bench.step_profiles import profile_prefill, profile_static_forward


def run_v2(args, device, ceilings, results) -> None:
    raw = v2_lite_config(args.tiny)
    model = build_dsmesh(raw, device, args.dtype)
    cfg = model.config
    prompt_len, context = args.prompt_len, args.context
    batches = args.batches
    engine = make_engine(model, device, max(batches), args, args.kv_cache_dtypes[0])
    out: dict[str, Any] = {
        "shape": "DeepSeek-V2-Lite",
        "dtype": str(args.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "attention_backend": getattr(engine.graph_runner, "attention_backend", None),
        "moe_backend": getattr(engine.graph_runner, "moe_backend", None),
    }
    t = bench_prefill(engine, cfg.vocab_size, prompt_len, args.prefill_prompts, args.repeats)
    flops = prefill_flops(cfg, prompt_len, args.prefill_prompts)
    out["prefill"] = {
        "prompt_len": prompt_len,
        "prompts_per_forward": args.prefill_prompts,
        "seconds": t,
        "tokens_per_s": prompt_len * args.prefill_prompts / t,
        "TFLOPs": flops / t / 1e12,
        "matmul_fraction": flops / t / 1e12 / ceilings["matmul_TFLOPs"],
    }
    if args.profile:
        table = profile_prefill(engine, cfg.vocab_size, prompt_len, args.prefill_prompts)
        out["prefill"]["profile"] = table
        print(f"  prefill forward:\n{table}", flush=True)
    rows = []
    for b in batches:
        w = weight_bytes_touched(model, b)
        kv = kv_bytes(cfg, b, context, pool_token_bytes(engine))
        roofline = (w["routed_experts"] + w["other"] + kv) / (ceilings["copy_GBps"] * 1e9)
        row: dict[str, Any] = {
            "batch": b,
            "context": context,
            "weight_bytes": w["routed_experts"] + w["other"],
            "kv_bytes": kv,
            "roofline_ms": roofline * 1e3,
        }
        for graphs in (True, False) if args.eager else (True,):
            profiled = args.profile and graphs and b == max(batches)
            host: dict[str, str] | None = {} if profiled else None
            step = bench_decode(engine, cfg.vocab_size, b, context, args.steps, 3, graphs, host)
            row["graphs" if graphs else "eager"] = {
                "step_ms": step * 1e3,
                "tokens_per_s": b / step,
                "roofline_fraction": roofline / step,
            }
            if graphs:
                replay = graph_replay_seconds(engine.graph_runner, b, device)
                if replay is not None:
                    row["graphs"]["replay_ms"] = replay * 1e3
                    row["graphs"]["replay_roofline_fraction"] = roofline / replay
                runner = engine.graph_runner
                if b == max(batches) and engine.config.overlap_decode:
                    # Baseline in the same run: each step finishing before the next starts.
                    on = engine.config
                    engine.config = dataclasses.replace(on, overlap_decode=False)
                    base = bench_decode(engine, cfg.vocab_size, b, context, args.steps, 3, True)
                    engine.config = on
                    row["graphs_no_overlap"] = {"step_ms": base * 1e3}
                if b == max(batches) and getattr(runner, "moe_backend", "") == "fused":
                    # Baseline in the same run: the grouped-GEMM MoE path it replaced.
                    engine.switch_kernels(moe_backend="grouped")
                    base = bench_decode(engine, cfg.vocab_size, b, context, args.steps, 3, True)
                    replay = graph_replay_seconds(runner, b, device)
                    row["graphs_grouped_moe"] = {
                        "step_ms": base * 1e3,
                        "replay_ms": replay * 1e3 if replay else None,
                    }
                    engine.switch_kernels(moe_backend="auto")
                if args.attention_ab and runner is not None:
                    key, ab = bench_other_attention(
                        engine, cfg.vocab_size, b, context, args.steps, device
                    )
                    row[key] = ab
                if host:
                    row["graphs"]["host_profile"] = host["table"]
                    row["graphs"]["step_trace"] = host["trace"]
                    print(f"  host profile, batch {b}:\n{host['table']}", flush=True)
                    print(f"  step trace, batch {b}:\n{host['trace']}", flush=True)
                if args.profile and b in (min(batches), max(batches)):
                    table = profile_static_forward(engine.graph_runner, b, device)
                    out.setdefault("profiles", {})[str(b)] = table
                    print(f"  static decode forward, batch {b}:\n{table}", flush=True)
        rows.append(row)
        print(f"  v2 decode batch {b}: {row}", flush=True)
    out["decode"] = rows
    out["graphs_captured"] = sorted(getattr(engine.graph_runner, "graphs", {}))
    results["v2_lite"] = out
    del engine, model
