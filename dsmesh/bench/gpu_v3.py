"""Part ``v3`` of the GPU benchmark (dsmesh/bench/gpu.py): a few DeepSeek-V3 layers (every one
MoE, routed experts in FP8 on CUDA and, as DeepSeek-V3 ships them, the attention projections
and shared experts too: ``--v3-dense-dtype bf16`` keeps those in bf16, the shape measured
before 2026-12-06) with random weights. Prefill and decode throughput per
layer against the seed's per-GPU figures scaled per layer, decode against the HBM roofline,
and the decode steps again with each further KV cache dtype (``--kv-cache-dtype``)."""

from __future__ import annotations

from typing import Any

import torch

from dsmesh.bench.engine_steps import (
    bench_decode,
    bench_other_attention,
    bench_prefill,
    graph_replay_seconds,
    make_engine,
)
from dsmesh.bench.random_model import (
    build_dsmesh,
    use_fp8_experts,
    use_fp8_linears,
    v3_layers_config,
)
from dsmesh.bench.roofline import kv_bytes, pool_token_bytes, prefill_flops, weight_bytes_touched
from dsmesh.bench.step_profiles import profile_prefill, profile_static_forward
from dsmesh.engine.model.config import ModelConfig

SEED_INPUT_PER_GPU = 6500.0  # tokens/s, 61-layer V3 (52.3k per 8-GPU node)
SEED_OUTPUT_PER_GPU = 2800.0  # tokens/s (22.3k per node)
V3_LAYERS = 61


def fp8_expert_gemm(cfg: ModelConfig, tokens: int) -> str:
    """The grouped GEMM FP8 experts run on for a forward of ``tokens`` tokens (EP 1): DeepGEMM
    where it is installed and the experts get enough rows each, else Triton."""
    from dsmesh.kernels.backends import choose
    from dsmesh.kernels.moe_gemm_deepgemm import prefers_deep_gemm

    rows = tokens * cfg.moe.num_experts_per_tok
    if choose("moe_fp8_gemm") == "deep_gemm" and prefers_deep_gemm(rows, cfg.moe.n_routed_experts):
        return "deep_gemm"
    return "triton"


def run_v3(args, device, ceilings, results) -> None:
    layers = args.v3_layers
    model = build_dsmesh(v3_layers_config(layers, args.tiny), device, args.dtype)
    fp8 = device.type == "cuda" and use_fp8_experts(model)
    fp8_dense = fp8 and args.v3_dense_dtype == "fp8" and use_fp8_linears(model) > 0
    cfg = model.config
    b = args.v3_batch
    engine = make_engine(model, device, b, args, args.kv_cache_dtypes[0])
    t_pre = bench_prefill(engine, cfg.vocab_size, args.prompt_len, args.prefill_prompts, 2)
    pre_tokens = args.prompt_len * args.prefill_prompts / t_pre
    host: dict[str, str] | None = {} if args.profile else None
    step = bench_decode(engine, cfg.vocab_size, b, args.context, args.steps, 3, True, host)
    dec_tokens = b / step
    replay = graph_replay_seconds(engine.graph_runner, b, device)
    flops = prefill_flops(cfg, args.prompt_len, args.prefill_prompts)
    seed_in = SEED_INPUT_PER_GPU * V3_LAYERS
    seed_out = SEED_OUTPUT_PER_GPU * V3_LAYERS
    w = weight_bytes_touched(model, b)
    kv = kv_bytes(cfg, b, args.context, pool_token_bytes(engine))
    roofline = (w["routed_experts"] + w["other"] + kv) / (ceilings["copy_GBps"] * 1e9)
    ab = None
    if args.attention_ab and engine.graph_runner is not None:
        ab = bench_other_attention(engine, cfg.vocab_size, b, args.context, args.steps, device)
    results["v3_layers"] = {
        "shape": "DeepSeek-V3 layers (all MoE), vocab 4096",
        "num_layers": layers,
        "attention_backend": getattr(engine.graph_runner, "attention_backend", None),
        "kv_cache_dtype": args.kv_cache_dtypes[0],
        "weights": _weights_text(fp8, fp8_dense),
        "fp8_linear_gemm": engine.model.kernels.fp8_linear if fp8_dense else None,
        "fp8_expert_gemm": {
            "prefill": fp8_expert_gemm(cfg, args.prompt_len * args.prefill_prompts),
            "decode": fp8_expert_gemm(cfg, b),
        }
        if fp8
        else None,
        "prefill": {
            "prompt_len": args.prompt_len,
            "prompts_per_forward": args.prefill_prompts,
            "tokens_per_s": pre_tokens,
            "token_layers_per_s": pre_tokens * layers,
            "TFLOPs": flops / t_pre / 1e12,
            "seed_token_layers_per_s_per_gpu": seed_in,
            "ratio_to_seed": pre_tokens * layers / seed_in,
        },
        "decode": {
            "batch": b,
            "context": args.context,
            "step_ms": step * 1e3,
            "step_ms_per_layer": step * 1e3 / layers,
            "tokens_per_s": dec_tokens,
            "token_layers_per_s": dec_tokens * layers,
            "kv_bytes": kv,
            "roofline_ms": roofline * 1e3,
            "roofline_fraction": roofline / step,
            "replay_ms": None if replay is None else replay * 1e3,
            "seed_token_layers_per_s_per_gpu": seed_out,
            "ratio_to_seed": dec_tokens * layers / seed_out,
        },
    }
    if ab is not None:
        key, figures = ab
        results["v3_layers"]["decode"][key] = figures
    if args.profile:  # where the prefill forward's and the decode step's time goes
        profiles = {
            "prefill": profile_prefill(
                engine, cfg.vocab_size, args.prompt_len, args.prefill_prompts
            ),
        }
        if engine.graph_runner is not None:
            profiles["decode"] = profile_static_forward(engine.graph_runner, b, device)
        if host:  # the decode step's host functions and its torch.profiler trace
            profiles["decode_host"] = host["table"]
            profiles["decode_trace"] = host["trace"]
        results["v3_layers"]["profiles"] = profiles
        for name, table in profiles.items():
            print(f"  v3 {name} profile, batch {b}, context {args.context}:\n{table}", flush=True)
    del engine
    for name in args.kv_cache_dtypes[1:]:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        other = bench_kv_cache_dtype(model, device, b, args, name, ceilings)
        results["v3_layers"]["decode"][f"kv_{name}"] = other
        print(f"  v3 decode b{b} with {name} KV: {other}", flush=True)
    del model


def _weights_text(fp8_experts: bool, fp8_dense: bool) -> str:
    if fp8_dense:
        return (
            "routed experts and attention projections / shared experts fp8 (128x128 blocks); "
            "kv_b_proj, embeddings, LM head bf16"
        )
    if fp8_experts:
        return "routed experts fp8 (128x128 blocks), the rest bf16"
    return "all bf16"


def bench_kv_cache_dtype(model, device, batch: int, args, name: str, ceilings) -> dict[str, Any]:
    """The decode steps of ``run_v3`` again with the KV cache in ``name`` (a new engine on
    the same weights, its pool prefilled with random values): step and replay time, the KV
    bytes read and the roofline."""
    engine = make_engine(model, device, batch, args, name)
    cfg = model.config
    step = bench_decode(engine, cfg.vocab_size, batch, args.context, args.steps, 3, True)
    replay = graph_replay_seconds(engine.graph_runner, batch, device)
    w = weight_bytes_touched(model, batch)
    kv = kv_bytes(cfg, batch, args.context, pool_token_bytes(engine))
    roofline = (w["routed_experts"] + w["other"] + kv) / (ceilings["copy_GBps"] * 1e9)
    return {
        "kv_cache_dtype": name,
        "attention_backend": getattr(engine.graph_runner, "attention_backend", None),
        "step_ms": step * 1e3,
        "step_ms_per_layer": step * 1e3 / cfg.num_hidden_layers,
        "tokens_per_s": batch / step,
        "kv_bytes": kv,
        "roofline_ms": roofline * 1e3,
        "roofline_fraction": roofline / step,
        "replay_ms": None if replay is None else replay * 1e3,
    }
