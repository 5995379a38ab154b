"""GPU benchmark: dsmesh on random-weight DeepSeek shapes against the hardware and transformers.

    python -m dsmesh.bench.gpu --out results.json [--parts v2,v3,hf] [--tiny] [--device cuda]

Reports, as a table and JSON (written after every part, so a cut-short run keeps what it did):

- ceilings measured here: device copy bandwidth (bytes read + written) and the dense matmul
  rate (bf16 on CUDA);
- a. DeepSeek-V2-Lite shape (the released config, random bf16 weights in the engine's own
  model classes): prefill tokens/s at 2000-token prompts and its FLOP rate against the
  matmul ceiling; decode tokens/s at batch 1/32/128/256 with 2000-token contexts, with and
  without CUDA graphs, against the HBM roofline (weights touched + KV read over the copy
  bandwidth);
- b. DeepSeek-V3 layer shape (a few MoE layers, small vocabulary): prefill and decode
  throughput per layer against the seed's per-GPU figures scaled per layer; with
  ``--kv-cache-dtype auto,fp8_e4m3`` the decode steps again with each further KV cache
  dtype (``decode["kv_fp8_e4m3"]``), e.g. bf16 against FP8 KV at 32K contexts:
  ``--parts v3 --v3-batch 64 --context 32768 --kv-cache-dtype auto,fp8_e4m3``;
- c. transformers' DeepseekV2ForCausalLM on the V2-Lite shape (same GPU, batch and
  context): prefill and decode tokens/s, and dsmesh's speed-up.

Decode requests are placed as a decode instance receives them (``reserve`` + ``activate``:
the prompt's KV is already in the pages, here random values), so decode is measured without
prefilling 256 x 2000 tokens first. ``--tiny`` runs every code path on tiny shapes (CPU
smoke test); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsmesh.engine.kv.pool import KV_CACHE_DTYPES
from dsmesh.engine.model.build import build_model
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.deepseek import DeepseekForCausalLM

SEED_INPUT_PER_GPU = 6500.0  # tokens/s, 61-layer V3 (52.3k per 8-GPU node)
SEED_OUTPUT_PER_GPU = 2800.0  # tokens/s (22.3k per node)
V3_LAYERS = 61

# ---- shapes ----------------------------------------------------------------------------------


def v2_lite_config(tiny: bool = False) -> dict[str, Any]:
    """DeepSeek-V2-Lite's released config.json (official spelling); ``tiny`` shrinks it."""
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "attention_bias": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "tie_word_embeddings": False,
    }
    if tiny:
        cfg.update(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            bos_token_id=0,
            eos_token_id=1,
        )
    return cfg


def v3_layers_config(num_layers: int, tiny: bool = False, fp8: bool = False) -> dict[str, Any]:
    """DeepSeek-V3's layer shape, every layer MoE, a small vocabulary (per-layer figures)."""
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "vocab_size": 4096,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if tiny:
        cfg.update(
            vocab_size=512,
            hidden_size=64,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    return cfg


# ---- measuring -------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn`` (synchronised before and after each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings(device: torch.device, tiny: bool) -> dict[str, Any]:
    """Copy bandwidth (read + write) and dense matmul rate, on random data."""
    n_bytes = (64 << 20) if tiny else (4 << 30)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t_copy = time_it(lambda: dst.copy_(src), device, repeats=5 if tiny else 20, warmup=2)
    src = dst = None  # free before the matmul buffers
    n = 256 if tiny else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t_mm = time_it(lambda: a @ b, device, repeats=3 if tiny else 20, warmup=2)
    return {
        "copy_GBps": 2 * n_bytes / t_copy / 1e9,
        "matmul_TFLOPs": 2 * n**3 / t_mm / 1e12,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_size": n,
        "copy_bytes": n_bytes,
    }


# ---- models ----------------------------------------------------------------------------------


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights drawn on the model's device (fast for billions of parameters):
    N(0, std) for matrices (float32 router weights rounded to the model dtype's values, as a
    checkpoint holds them), 1 for norm weights, small noise for V3's correction bias."""
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        if not t.is_floating_point() or t.element_size() == 1 or name.endswith("inv_freq"):
            continue
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        if name.endswith("gate.weight") and t.dtype != dtype:
            t.copy_(t.to(dtype))  # float32 router weights hold bf16 values, as checkpoints do


def build_dsmesh(
    raw: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> DeepseekForCausalLM:
    model = build_model(ModelConfig.from_dict(raw), dtype, device)
    init_random_(model, seed)
    return model


def expert_bytes(experts: torch.nn.Module) -> float:
    """Bytes of one rank's routed experts as the forward reads them (FP8 + scales when an
    FP8 form is attached, else the dense stacks)."""
    fp8 = getattr(experts, "fp8", None)
    if fp8 is not None:
        tensors = [fp8.w13, fp8.w13_scale, fp8.w2, fp8.w2_scale]
    else:
        tensors = [experts.w13, experts.w2]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def weight_bytes_touched(model: DeepseekForCausalLM, batch: int) -> dict[str, float]:
    """Bytes of weights one decode step reads: every non-routed weight (embedding: only the
    batch's rows), and per MoE layer the routed experts expected to receive a token under
    uniform routing, E * (1 - (1 - k/E)^batch)."""
    k = model.config.moe.num_experts_per_tok
    routed = other = 0.0
    for moe in model.moe_layers():
        e = moe.experts.num_local
        routed += expert_bytes(moe.experts) / e * e * (1 - (1 - k / e) ** batch)
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts.w13" in name or ".experts.w2" in name:
            continue
        if name.endswith("embed_tokens.weight"):
            other += size / p.shape[0] * min(batch, p.shape[0])
        else:
            other += size
    return {"routed_experts": routed, "other": other}


def use_fp8_experts(model: DeepseekForCausalLM) -> bool:
    """Quantise every layer's routed experts to block-scaled FP8 (128x128, as DeepSeek-V3
    ships them) and drop the dense copies, when the engine has an FP8 expert path."""
    try:
        from dsmesh.kernels.fp8 import Fp8ExpertWeights
    except ImportError:
        return False
    layers = model.moe_layers()
    if not layers or not hasattr(layers[0].experts, "fp8"):
        return False
    for moe in layers:
        ex = moe.experts
        ex.fp8 = Fp8ExpertWeights.from_dense(ex.w13.data, ex.w2.data)
        if not ex.fp8.usable:
            ex.fp8 = None
            return False
        ex.w13 = torch.nn.Parameter(ex.w13.data.new_empty(ex.w13.shape[0], 0, 0))
        ex.w2 = torch.nn.Parameter(ex.w2.data.new_empty(ex.w2.shape[0], 0, 0))
        if ex.w13.is_cuda:
            torch.cuda.empty_cache()
    return True


def prefill_flops(cfg: ModelConfig, prompt_len: int, num_prompts: int) -> float:
    """Useful FLOPs of prefilling ``num_prompts`` prompts: 2 x active weights per token plus
    causal attention (naive MLA: per head q.k over qk_head_dim and p.v over v_head_dim)."""
    mla, moe, h = cfg.mla, cfg.moe, cfg.hidden_size
    heads = mla.num_heads
    if mla.q_lora_rank is None:
        q = h * heads * mla.qk_head_dim
    else:
        q = h * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
    attn = (
        q
        + h * mla.kv_cache_dim
        + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        + heads * mla.v_head_dim * h
    )
    per_token = 0.0
    for i in range(cfg.num_hidden_layers):
        per_token += attn
        if cfg.is_moe_layer(i):
            inter = moe.moe_intermediate_size
            per_token += 3 * h * inter * (moe.num_experts_per_tok + moe.n_shared_experts)
            per_token += h * moe.n_routed_experts
        else:
            per_token += 3 * h * cfg.intermediate_size
    tokens = prompt_len * num_prompts
    pairs = prompt_len * (prompt_len + 1) / 2 * num_prompts
    attention = 2 * pairs * heads * (mla.qk_head_dim + mla.v_head_dim) * cfg.num_hidden_layers
    return 2 * per_token * tokens + attention + 2 * h * cfg.vocab_size * num_prompts


def kv_bytes(cfg: ModelConfig, batch: int, context: int, token_bytes: int) -> float:
    """KV bytes a decode step reads: ``token_bytes`` per token and layer
    (dsmesh.engine.kv.pool.kv_bytes_per_token: values, and FP8's scales)."""
    return batch * context * cfg.num_hidden_layers * token_bytes


def pool_token_bytes(engine) -> int:
    """Bytes of one token in one layer of ``engine``'s KV pool."""
    from dsmesh.engine.kv.pool import kv_bytes_per_token

    return kv_bytes_per_token(engine.kv_pool.kv_dim, engine.kv_pool.dtype)


def fill_kv_normal_(pool, gen: torch.Generator) -> None:
    """Every KV value a N(0, 1) draw ("prefilled" KV); an FP8 pool stores them quantised,
    a chunk of pages at a time."""
    if not pool.fp8:
        pool.buffer.normal_(0.0, 1.0, generator=gen)
        return
    from dsmesh.kernels.kv_fp8 import quantize_kv_fp8

    chunk = max(1, (1 << 22) // (pool.page_size * pool.kv_dim))
    for layer in range(pool.num_layers):
        for start in range(0, pool.num_pages, chunk):
            pages = slice(start, min(start + chunk, pool.num_pages))
            shape = (pages.stop - pages.start, pool.page_size, pool.kv_dim)
            x = torch.randn(shape, generator=gen, device=pool.buffer.device)
            values, scales = quantize_kv_fp8(x, pool.kv_lora_rank)
            pool.kv[layer, pages] = values
            pool.scales[layer, pages] = scales


# ---- dsmesh engine runs ----------------------------------------------------------------------


def add_cpu_graph_runner(engine, max_batch: int) -> None:
    """On CPU (no CUDA, so no runner): the graph runner's static decode path, run without
    capture, so ``--tiny`` smoke runs cover it."""
    if engine.graph_runner is not None or engine.device.type != "cpu":
        return
    from dsmesh.engine.runner.cuda_graph import CudaGraphRunner

    pool = engine.kv_pool
    engine.graph_runner = CudaGraphRunner(
        engine.model,
        pool,
        max_batch,
        min(engine.max_context, pool.num_pages * pool.page_size),
        use_graphs=False,
    )


def make_engine(model, device, max_batch: int, args, kv_cache_dtype: str = "auto"):
    """An engine whose pool (values in ``kv_cache_dtype``) holds ``max_batch`` decode
    requests of ``args.context`` tokens (plus the steps) and one prefill forward of
    ``args.prefill_prompts`` prompts."""
    from dsmesh.engine.kv.pool import pages_for
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine

    page_size = args.page_size
    per_decode = pages_for(args.context + args.steps + 8, page_size) * page_size
    per_prefill = pages_for(args.prompt_len + 1, page_size) * page_size
    prefill_tokens = args.prompt_len * args.prefill_prompts
    cfg = EngineConfig(
        device=str(device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=max(max_batch * per_decode, args.prefill_prompts * per_prefill),
        max_running_requests=max(max_batch, args.prefill_prompts),
        max_batch_tokens=max(prefill_tokens, max_batch),
        cuda_graph_max_batch=max_batch,
    )
    engine = LLMEngine(cfg, model=model)
    add_cpu_graph_runner(engine, max_batch)
    gen = torch.Generator(device=device).manual_seed(1)
    fill_kv_normal_(engine.kv_pool, gen)  # "prefilled" KV: random values
    return engine


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


def bench_prefill(engine, vocab: int, prompt_len: int, num_prompts: int, repeats: int) -> float:
    """Median seconds of one engine step prefilling ``num_prompts`` prompts together."""
    from dsmesh.engine.sampling.params import SamplingParams

    def once(seed: int) -> float:
        ids = [
            engine.add_request(
                random_prompt(vocab, prompt_len, seed * 100 + i),
                SamplingParams(max_new_tokens=1),
                prefill_only=True,
            )
            for i in range(num_prompts)
        ]
        sync(engine.device)
        t = time.perf_counter()
        out = engine.step()
        sync(engine.device)
        elapsed = time.perf_counter() - t
        assert sum(o.finished for o in out) == num_prompts, "prefill took more than one step"
        for rid in ids:
            engine.release(rid)
        return elapsed

    once(0)
    return statistics.median(once(r + 1) for r in range(repeats))


def bench_decode(
    engine,
    vocab: int,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    graphs: bool,
    host_profile: dict[str, str] | None = None,
) -> float:
    """Mean seconds of one decode step of ``batch`` requests at ``context`` tokens, over
    ``steps`` steps run back to back after ``warmup`` (which capture the graphs). With
    ``host_profile``, two more steps run under cProfile and its table (host functions by
    own time; the GPU wait shows as the call that synchronises) lands in ``host_profile``."""
    from dsmesh.engine.sampling.params import SamplingParams

    runner = engine.graph_runner
    engine.graph_runner = runner if graphs else None
    extra = 3 if host_profile is not None else 0  # the profiled steps
    params = SamplingParams(max_new_tokens=steps + warmup + extra + 1, ignore_eos=True)
    ids = []
    for i in range(batch):
        req = engine.reserve(random_prompt(vocab, context, i), params, f"d{batch}-{graphs}-{i}")
        engine.activate(req.request_id, 5)
        ids.append(req.request_id)
    try:
        for _ in range(warmup):
            assert len(engine.step()) == batch
        # Steps back to back, as a serving loop runs them (with overlapped decode a step's
        # host work runs while the GPU computes the next): the mean over the block.
        sync(engine.device)
        t = time.perf_counter()
        for _ in range(steps):
            out = engine.step()
            assert len(out) == batch, f"decode step served {len(out)} of {batch}"
        sync(engine.device)
        mean = (time.perf_counter() - t) / steps
        if host_profile is not None:
            host_profile["table"] = host_profile_steps(engine, 2)
            host_profile["trace"] = trace_step(engine)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.graph_runner = runner
    return mean


def host_profile_steps(engine, steps: int, rows: int = 22) -> str:
    """cProfile of ``steps`` engine steps, by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def trace_step(engine, rows: int = 30) -> str:
    """torch.profiler table (host and device) of one engine step, by host time; the chrome
    trace goes to $DSMESH_TRACE_DIR when set."""
    import os

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        engine.step()
        sync(engine.device)
    out_dir = os.environ.get("DSMESH_TRACE_DIR")
    if out_dir:
        prof.export_chrome_trace(str(Path(out_dir) / "decode_step_trace.json"))
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)


def profile_prefill(engine, vocab: int, prompt_len: int, num_prompts: int, rows: int = 30):
    """Kernel table (CUDA time) of one prefill step of ``num_prompts`` prompts."""
    if engine.device.type != "cuda":
        return ""
    from torch.profiler import ProfilerActivity, profile

    from dsmesh.engine.sampling.params import SamplingParams

    ids = [
        engine.add_request(
            random_prompt(vocab, prompt_len, 900 + i),
            SamplingParams(max_new_tokens=1),
            prefill_only=True,
        )
        for i in range(num_prompts)
    ]
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync(engine.device)
    for rid in ids:
        engine.release(rid)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def graph_replay_seconds(runner, batch: int, device: torch.device) -> float | None:
    """Median seconds of replaying the last-used graph of ``batch``'s bucket alone (no
    scheduling, upload or sampling): the GPU time of a decode step."""
    if runner is None or not runner.graphs:
        return None
    from dsmesh.engine.runner.graph_buckets import bucket_for

    b = bucket_for(batch, runner.buckets)
    keys = [k for k in runner.graphs if k[0] == b]
    if not keys:
        return None
    graph = runner.graphs[max(keys)][0]
    return time_it(graph.replay, device, repeats=10, warmup=2)


def profile_static_forward(runner, batch: int, device: torch.device, rows: int = 60) -> str:
    """Kernel table (CUDA time) of one decode forward at ``batch``, run uncaptured on the
    runner's buffers of the last step of that bucket."""
    from dsmesh.engine.runner.graph_buckets import bucket_for

    b = bucket_for(batch, runner.buckets)
    keys = [k for k in runner.keys_used if k[0] == b]
    if device.type != "cuda" or not keys:
        return ""
    from torch.profiler import ProfilerActivity, profile

    _, p = max(keys)
    with torch.inference_mode():
        runner.forward(b, p)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.forward(b, p)
            sync(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def bench_other_attention(engine, vocab: int, b: int, context: int, steps: int, device):
    """The same decode steps with the other MLA decode kernel in the graphs: dsmesh's Triton
    kernel when "auto" chose FlashInfer, else FlashInfer (A/B in the same run). Returns the
    key to record it under and its figures, or the reason it cannot run here."""
    runner = engine.graph_runner
    other = "kernel" if runner.attention_backend == "flashinfer" else "flashinfer"
    key = f"graphs_{'triton' if other == 'kernel' else other}_attention"
    try:
        engine.switch_kernels(decode_attention=other)
    except Exception as exc:  # not installed, or it fails to build: say so in the results
        return key, {"error": f"{type(exc).__name__}: {exc}"}
    try:
        step = bench_decode(engine, vocab, b, context, steps, 3, True)
        replay = graph_replay_seconds(runner, b, device)
        return key, {"step_ms": step * 1e3, "replay_ms": replay * 1e3 if replay else None}
    finally:
        engine.switch_kernels(decode_attention="auto")


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
    cfg = model.config
    b = args.v3_batch
    engine = make_engine(model, device, b, args, args.kv_cache_dtypes[0])
    t_pre = bench_prefill(engine, cfg.vocab_size, args.prompt_len, args.prefill_prompts, 2)
    pre_tokens = args.prompt_len * args.prefill_prompts / t_pre
    step = bench_decode(engine, cfg.vocab_size, b, args.context, args.steps, 3, True)
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
        "weights": ("routed experts fp8 (128x128 blocks), the rest bf16" if fp8 else "all bf16"),
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
    del engine
    for name in args.kv_cache_dtypes[1:]:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        other = bench_kv_cache_dtype(model, device, b, args, name, ceilings)
        results["v3_layers"]["decode"][f"kv_{name}"] = other
        print(f"  v3 decode b{b} with {name} KV: {other}", flush=True)
    del model


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


# ---- transformers ----------------------------------------------------------------------------


def hf_v2_model(raw: dict[str, Any], device: torch.device, dtype: torch.dtype):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    rope = dict(raw["rope_scaling"])
    rope_type = rope.pop("type")
    kwargs = {
        k: v
        for k, v in raw.items()
        if k not in ("model_type", "rope_scaling", "rope_theta", "scoring_func", "moe_layer_freq")
    }
    kwargs.update(n_group=None, topk_group=None)
    kwargs["rope_parameters"] = {"rope_type": rope_type, "rope_theta": raw["rope_theta"], **rope}
    config = DeepseekV2Config(**kwargs, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    init_random_(model, seed=0)
    return model.eval()


@torch.no_grad()
def bench_hf(model, batch: int, context: int, steps: int, device) -> dict[str, float]:
    """transformers: one prefill forward of the batch, then greedy decode steps with its
    cache (the loop generate runs, without its bookkeeping)."""
    vocab = model.config.vocab_size
    ids = torch.tensor([random_prompt(vocab, context, i) for i in range(batch)], device=device)
    sync(device)
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    sync(device)
    prefill = time.perf_counter() - t
    cache = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 2):
        sync(device)
        t = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        sync(device)
        times.append(time.perf_counter() - t)
    step = statistics.median(times[2:])
    return {
        "prefill_seconds": prefill,
        "prefill_tokens_per_s": batch * context / prefill,
        "decode_step_ms": step * 1e3,
        "decode_tokens_per_s": batch / step,
    }


def run_hf(args, device, results) -> None:
    raw = v2_lite_config(args.tiny)
    model = hf_v2_model(raw, device, args.dtype)
    rows = []
    ours = {r["batch"]: r for r in results.get("v2_lite", {}).get("decode", [])}
    our_prefill = results.get("v2_lite", {}).get("prefill", {}).get("tokens_per_s")
    for b in args.hf_batches:
        row: dict[str, Any] = {"batch": b, "context": args.context}
        try:
            row.update(bench_hf(model, b, args.context, args.steps, device))
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        if b in ours:
            mine = ours[b]["graphs"]["tokens_per_s"]
            row["dsmesh_decode_tokens_per_s"] = mine
            row["decode_speedup"] = mine / row["decode_tokens_per_s"]
            if our_prefill:
                row["prefill_speedup"] = our_prefill / row["prefill_tokens_per_s"]
                # Generating 2000 + N tokens: prefill time plus N steps, both systems.
                n = 256
                ours_t = b * args.context / our_prefill + n * b / mine
                hf_t = row["prefill_seconds"] + n * row["decode_step_ms"] / 1e3
                row["generate_256_speedup"] = hf_t / ours_t
        rows.append(row)
        print(f"  transformers batch {b}: {row}", flush=True)
    results["transformers"] = {
        "model": "transformers DeepseekV2ForCausalLM (V2-Lite shape, random weights)",
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "rows": rows,
    }
    del model


# ---- report ----------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    v2 = results.get("v2_lite")
    if v2:
        big = max(v2["decode"], key=lambda r: r["batch"])
        frac = big["graphs"]["roofline_fraction"]
        out["decode_roofline"] = {"batch": big["batch"], "value": frac, "target": 0.7}
        out["decode_roofline"]["met"] = frac >= 0.7
        pf = v2["prefill"]["matmul_fraction"]
        out["prefill_matmul"] = {"value": pf, "target": 0.5, "met": pf >= 0.5}
    hf = results.get("transformers")
    if hf:
        ups = [r["decode_speedup"] for r in hf["rows"] if "decode_speedup" in r]
        if ups:
            out["vs_transformers"] = {"min_decode_speedup": min(ups), "target": 10.0}
            out["vs_transformers"]["met"] = min(ups) >= 10.0
    return out


def print_table(results: dict[str, Any]) -> None:
    c = results["ceilings"]
    print(f"\n{results['device']}  torch {results['torch']}  {results['date']}")
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    v2 = results.get("v2_lite")
    if v2:
        p = v2["prefill"]
        print(
            f"V2-Lite prefill: {p['tokens_per_s']:.0f} tok/s, {p['TFLOPs']:.1f} TFLOP/s "
            f"({100 * p['matmul_fraction']:.0f}% of matmul)"
        )
        print(
            "V2-Lite decode  batch | graphs ms  tok/s  %roof | replay ms %roof "
            "| eager ms  tok/s | roof ms"
        )
        for r in v2["decode"]:
            g, e = r["graphs"], r.get("eager", {"step_ms": float("nan"), "tokens_per_s": 0.0})
            replay = g.get("replay_ms", float("nan"))
            replay_frac = 100 * g.get("replay_roofline_fraction", float("nan"))
            print(
                f"  {r['batch']:>19} | {g['step_ms']:8.2f} {g['tokens_per_s']:7.0f} "
                f"{100 * g['roofline_fraction']:5.0f}% | {replay:9.2f} {replay_frac:4.0f}% "
                f"| {e['step_ms']:8.2f} {e['tokens_per_s']:6.0f} | {r['roofline_ms']:7.2f}"
            )
    v3 = results.get("v3_layers")
    if v3:
        p, d = v3["prefill"], v3["decode"]
        print(
            f"V3 x{v3['num_layers']} layers ({v3['weights']}): prefill "
            f"{p['token_layers_per_s']:.0f} token-layers/s ({p['ratio_to_seed']:.2f}x seed), "
            f"decode b{d['batch']} {d['token_layers_per_s']:.0f} token-layers/s "
            f"({d['ratio_to_seed']:.2f}x seed, {100 * d['roofline_fraction']:.0f}% roofline); "
            f"fp8 expert GEMM {v3['fp8_expert_gemm']}"
        )
        for other in d.values():
            if isinstance(other, dict) and "kv_cache_dtype" in other:
                print(
                    f"  decode b{d['batch']} at {d['context']} tokens: "
                    f"{v3['kv_cache_dtype']} KV {d['step_ms']:.2f} ms, "
                    f"{other['kv_cache_dtype']} KV {other['step_ms']:.2f} ms "
                    f"({d['step_ms'] / other['step_ms']:.2f}x)"
                )
    hf = results.get("transformers")
    if hf:
        for r in hf["rows"]:
            if "error" in r:
                print(f"transformers batch {r['batch']}: {r['error']}")
                continue
            print(
                f"transformers batch {r['batch']}: prefill {r['prefill_tokens_per_s']:.0f} "
                f"tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s; dsmesh decode "
                f"x{r.get('decode_speedup', float('nan')):.1f}, prefill "
                f"x{r.get('prefill_speedup', float('nan')):.1f}"
            )
    for name, t in results.get("targets", {}).items():
        print(f"target {name}: {t}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results.json"))
    ap.add_argument("--parts", default="v2,v3,hf", help="comma list of v2, v3, hf")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--hf-batches", default="1,32,128")
    ap.add_argument("--profile", action="store_true", help="kernel tables of decode forwards")
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time decode without CUDA graphs (the graph speed-up)",
    )
    ap.add_argument(
        "--attention-ab",
        action="store_true",
        help="also time decode with the MLA kernel 'auto' did not pick (Triton or FlashInfer)",
    )
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--v3-layers", type=int, default=4)
    ap.add_argument("--v3-batch", type=int, default=256)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma list of KV cache dtypes (auto, fp8_e4m3): the first for every engine, "
        "the others time V3's decode again in the same run (decode['kv_<dtype>'])",
    )
    args = ap.parse_args(argv)
    args.kv_cache_dtypes = args.kv_cache_dtype.split(",")
    for name in args.kv_cache_dtypes:
        if name not in KV_CACHE_DTYPES:
            ap.error(f"--kv-cache-dtype: {name!r} is not one of {KV_CACHE_DTYPES}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    args.parts = set(args.parts.split(","))
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    import transformers

    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers_version": transformers.__version__,
        "tiny": args.tiny,
        "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
    }
    results["args"] = json.loads(json.dumps(results["args"], default=str))
    results["ceilings"] = measure_ceilings(device, args.tiny)
    print(f"ceilings: {results['ceilings']}", flush=True)

    def save() -> None:
        results["targets"] = targets(results)
        args.out.write_text(json.dumps(results, indent=2))

    for part, fn in (("v2", run_v2), ("v3", run_v3), ("hf", run_hf)):
        if part not in args.parts:
            continue
        t = time.perf_counter()
        try:
            if part == "hf":
                fn(args, device, results)
            else:
                fn(args, device, results["ceilings"], results)
        except Exception as exc:  # keep the other parts' figures
            results.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
            print(f"part {part} failed: {exc!r}", flush=True)
            if args.tiny:
                raise
        results.setdefault("part_seconds", {})[part] = time.perf_counter() - t
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    save()
    print_table(results)
    return results


if __name__ == "__main__":
    main()
