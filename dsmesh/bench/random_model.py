"""The random-weight DeepSeek models the GPU benchmarks run, and their random inputs.

DeepSeek-V2-Lite's released config and DeepSeek-V3's layer shape as config dicts (official
spelling; ``tiny`` shrinks them for CPU smoke runs), built in the engine's own model classes
with random weights drawn on the device; V3's routed experts and dense linears optionally in
block-scaled FP8, as DeepSeek-V3 ships them; a KV pool filled with random values (as if
prefilled) and random prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from dsmesh.engine.model.build import build_model
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.deepseek import DeepseekForCausalLM


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


def use_fp8_linears(model: DeepseekForCausalLM) -> int:
    """Quantise the attention projections (but kv_b_proj, read dense by the absorbed decode)
    and the shared experts / dense MLPs to block-scaled FP8 (128x128), as DeepSeek-V3's
    checkpoint stores them and ``--fp8-linears`` keeps them (dsmesh/engine/model/fp8_linear.py).
    Call before the model's kernels are set. Returns how many linears were quantised."""
    from dsmesh.engine.model.fp8_linear import fp8_candidates, quantize_linears

    names = fp8_candidates(model)
    quantize_linears(model, names)
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()
    return len(names)


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


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()
