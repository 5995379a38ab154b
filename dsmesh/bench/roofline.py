"""Measuring against the hardware: timing on the device, the ceilings measured there (copy
bandwidth, dense matmul rate), and the work a forward does (weight and KV bytes a decode
step reads, FLOPs of a prefill) that roofline figures divide by those ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.deepseek import DeepseekForCausalLM


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
    """Bytes of weights one decode step reads: every non-routed weight at its stored size
    (linears held in FP8: one byte a weight plus their float32 block scales; the embedding:
    only the batch's rows), and per MoE layer the routed experts expected to receive a token
    under uniform routing, E * (1 - (1 - k/E)^batch)."""
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
