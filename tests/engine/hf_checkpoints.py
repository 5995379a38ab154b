"""Tiny random DeepSeek-V2/V3 checkpoints built with transformers, and helpers to run them.

Each ``make_hf_*`` builds a transformers model with seeded, deliberately large random weights
(N(0, 0.15) for matrices, 1 + 0.1 N(0, 1) for norms, N(0, 0.1) for V3's correction bias), so
that attention, YaRN and routing all change the logits. The checkpoint is written with
``save_pretrained`` and its ``config.json`` is then rewritten in the *official* DeepSeek
spelling (``rope_theta`` + ``rope_scaling: {type: yarn}``, ``topk_method``, ``scoring_func``,
``moe_layer_freq``), which is what real DeepSeek releases ship.

Shapes are tiny (hidden 64, 3 layers, 8 routed experts) so a test file runs in seconds on CPU.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedModel,
)

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk

WEIGHT_STD = 0.15
NORM_NOISE_STD = 0.1
BIAS_STD = 0.1

# YaRN that matters on ~100-token prompts: interpolation starts past 64 positions.
YARN = {
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
ROPE_THETA = 10000.0
MAX_POSITION_EMBEDDINGS = 512

# Shared by both versions; MLA dims differ on purpose (nope 16, rope 16, v 32) to catch mixups.
_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # MLA has no KV groups; transformers' V3 default (128) breaks
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "first_k_dense_replace": 1,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# Keys transformers writes that the official DeepSeek config.json does not have.
_TRANSFORMERS_ONLY_KEYS = (
    "rope_parameters",
    "rope_interleave",
    "head_dim",
    "qk_head_dim",
    "output_router_logits",
    "num_mtp_layers",
    "mlp_bias",
    "dtype",
)


@dataclass(frozen=True)
class HFCheckpoint:
    """A transformers model and the folder of its official-spelling checkpoint (read-only)."""

    hf_model: PreTrainedModel
    path: Path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private, writable copy of a checkpoint folder."""
    shutil.copytree(src, dst)
    return dst


def edit_config(checkpoint_dir: Path, **changes: Any) -> None:
    """Set top-level ``config.json`` fields of a (copied) checkpoint."""
    path = Path(checkpoint_dir) / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw, indent=2))


def _rope_parameters(yarn: bool) -> dict[str, Any]:
    if not yarn:
        return {"rope_type": "default", "rope_theta": ROPE_THETA}
    return {"rope_type": "yarn", "rope_theta": ROPE_THETA, **YARN}


@torch.no_grad()
def randomize_(model: PreTrainedModel, seed: int) -> None:
    """Seeded large-scale init of every parameter, and of V3's correction bias buffers."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + NORM_NOISE_STD * noise)
        else:
            param.copy_(WEIGHT_STD * noise)
    for name, buf in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buf.copy_(BIAS_STD * torch.randn(buf.shape, generator=gen, dtype=torch.float32))


def to_official_config(hf: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A transformers-5 ``config.json`` dict rewritten in the official DeepSeek spelling."""
    out = {k: v for k, v in hf.items() if k not in _TRANSFORMERS_ONLY_KEYS}
    params = dict(hf.get("rope_parameters") or {})
    out["rope_theta"] = params.get("rope_theta", ROPE_THETA)
    if params.get("rope_type", "default") == "yarn":
        out["rope_scaling"] = {"type": "yarn", **{k: params[k] for k in YARN}}
    else:
        out["rope_scaling"] = None
    out["torch_dtype"] = hf.get("dtype", "float32")
    out["moe_layer_freq"] = 1
    out.update(extra)
    return out


def _save(model: PreTrainedModel, path: Path, extra: dict[str, Any]) -> None:
    model.save_pretrained(path)
    config_path = path / "config.json"
    hf_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(to_official_config(hf_config, extra), indent=2))


def v3_config(
    *, q_lora_rank: int | None = 48, yarn: bool = True, **overrides: Any
) -> DeepseekV3Config:
    kwargs = {
        **_COMMON,
        "q_lora_rank": q_lora_rank,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_mtp_layers": 0,
        "rope_parameters": _rope_parameters(yarn),
        **overrides,
    }
    return DeepseekV3Config(**kwargs, attn_implementation="eager")


def v2_config(
    *,
    topk_method: str = "greedy",
    q_lora_rank: int | None = None,
    yarn: bool = True,
    **overrides: Any,
) -> DeepseekV2Config:
    grouped = topk_method == "group_limited_greedy"
    kwargs = {
        **_COMMON,
        "q_lora_rank": q_lora_rank,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4 if grouped else None,
        "topk_group": 2 if grouped else None,
        "topk_method": topk_method,
        # transformers' V2 router never normalises the top-k weights; it only scales them.
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "rope_parameters": _rope_parameters(yarn),
        **overrides,
    }
    return DeepseekV2Config(**kwargs, attn_implementation="eager")


def make_hf_v3(
    tmp_dir: str | Path,
    *,
    q_lora_rank: int | None = 48,
    yarn: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> tuple[DeepseekV3ForCausalLM, Path]:
    """A random tiny DeepSeek-V3 (sigmoid, noaux_tc, 4 groups of 2) saved under ``tmp_dir``."""
    model = DeepseekV3ForCausalLM(v3_config(q_lora_rank=q_lora_rank, yarn=yarn, **overrides))
    randomize_(model, seed)
    model.eval()
    path = Path(tmp_dir)
    extra = {
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "q_lora_rank": q_lora_rank,
        "num_nextn_predict_layers": 0,
    }
    _save(model, path, extra)
    return model, path


def make_hf_v2(
    tmp_dir: str | Path,
    *,
    topk_method: str = "greedy",
    q_lora_rank: int | None = None,
    yarn: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> tuple[DeepseekV2ForCausalLM, Path]:
    """A random tiny DeepSeek-V2 (softmax, ``topk_method``, top-3 of 8) under ``tmp_dir``."""
    model = DeepseekV2ForCausalLM(
        v2_config(topk_method=topk_method, q_lora_rank=q_lora_rank, yarn=yarn, **overrides)
    )
    randomize_(model, seed)
    model.eval()
    path = Path(tmp_dir)
    extra = {
        "topk_method": topk_method,
        "scoring_func": "softmax",
        "q_lora_rank": q_lora_rank,
        "num_nextn_predict_layers": 0,
    }
    if topk_method != "group_limited_greedy":
        extra.update(n_group=1, topk_group=1)
    _save(model, path, extra)
    return model, path


# ---------------------------------------------------------------------------------------------
# Running prompts through either implementation
# ---------------------------------------------------------------------------------------------


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one unpadded prompt run alone."""
    out = hf_model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


def new_pool(model: DeepseekForCausalLM, num_pages: int, page_size: int) -> MLAKVPool:
    cfg = model.config
    return MLAKVPool(
        cfg.num_hidden_layers, num_pages, page_size, cfg.mla.kv_cache_dim, torch.float32
    )


def prefill_logits(
    model: DeepseekForCausalLM, prompts: list[list[int]], mode: str = "auto", page_size: int = 16
) -> list[torch.Tensor]:
    """All prompts in ONE forward call; per-prompt logits [len(prompt), vocab]."""
    pool = new_pool(model, sum(pages_for(len(p), page_size) for p in prompts), page_size)
    chunks = [
        SequenceChunk(p, 0, torch.tensor(pool.allocator.allocate(pages_for(len(p), page_size))))
        for p in prompts
    ]
    batch = ForwardBatch.build(chunks, page_size, "cpu")
    logits = model(batch, pool, attention_mode=mode, all_logits=True)
    return list(logits.split([len(p) for p in prompts]))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| over the whole tensor."""
    return float((ours - ref).abs().max() / ref.abs().max())


def add_mtp_layer(checkpoint_dir: Path, seed: int, std: float = WEIGHT_STD) -> None:
    """Give a (copied) V3 checkpoint one multi-token-prediction layer, as DeepSeek-V3 ships
    it: ``num_nextn_predict_layers: 1`` and random ``model.layers.{num_hidden_layers}.*``
    tensors (with the checkpoint's copies of the embedding and the LM head) in a second file,
    ``mtp.safetensors``. transformers ignores the layer; the engine drafts with it."""
    from safetensors.torch import load_file, save_file

    from dsmesh.engine.model.config import load_config
    from dsmesh.engine.model.mtp import build_mtp, init_random_mtp
    from dsmesh.engine.model.mtp_weights import mtp_state_dict

    edit_config(checkpoint_dir, num_nextn_predict_layers=1)
    cfg = load_config(checkpoint_dir)
    draft = build_mtp(cfg, torch.float32, "cpu")
    init_random_mtp(draft, seed, std)
    tensors = mtp_state_dict(draft)
    main = load_file(str(Path(checkpoint_dir) / "model.safetensors"))
    layer = f"model.layers.{cfg.num_hidden_layers}"
    tensors[f"{layer}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    tensors[f"{layer}.shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file(tensors, str(Path(checkpoint_dir) / "mtp.safetensors"), metadata={"format": "pt"})


def fp8_linear_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """As in DeepSeek-V3's release: every 2-D linear weight except embeddings, head, router."""
    return sorted(
        n
        for n, t in tensors.items()
        if t.dim() == 2
        and n not in ("model.embed_tokens.weight", "lm_head.weight")
        and not n.endswith("mlp.gate.weight")
    )


def make_fp8_copy(
    ckpt: HFCheckpoint, dst: Path, block: tuple[int, int] = (128, 128)
) -> HFCheckpoint:
    """``ckpt`` as DeepSeek-V3 ships its weights: every linear weight (attention
    projections, dense MLP, shared and routed experts) in float8_e4m3fn with
    ``weight_scale_inv`` blocks of ``block``, and ``quantization_config`` in config.json.
    Its transformers model holds the dequantised weights, so it is the reference of a load
    that dequantises."""
    import copy

    from safetensors.torch import load_file, save_file

    from dsmesh.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block

    source = load_file(str(ckpt.path / "model.safetensors"))
    stored, dense = dict(source), dict(source)
    for name in fp8_linear_names(source):
        q, scale_inv = quantize_fp8_block(source[name], block)
        stored[name], stored[name + "_scale_inv"] = q, scale_inv
        dense[name] = dequantize_fp8_block(q, scale_inv, block)
    dst.mkdir(parents=True)
    save_file(stored, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((ckpt.path / "config.json").read_text())
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
    }
    edit_config(dst, quantization_config=quant)
    hf_model = copy.deepcopy(ckpt.hf_model)
    hf_model.load_state_dict(_hf_state(hf_model, dense), strict=True)
    return HFCheckpoint(hf_model.eval(), dst)


def _hf_state(hf_model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict:
    """``tensors`` (checkpoint names) as ``hf_model``'s state dict: transformers stacks each
    layer's routed experts (``experts.gate_up_proj`` [E, 2I, H] gate rows then up rows,
    ``experts.down_proj`` [E, H, I])."""
    state = {}
    for key, current in hf_model.state_dict().items():
        if key in tensors:
            state[key] = tensors[key]
            continue
        prefix, kind = key.rsplit(".", 1)
        count = current.shape[0]
        if kind == "gate_up_proj":
            parts = [
                torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"],
                           tensors[f"{prefix}.{e}.up_proj.weight"]])
                for e in range(count)
            ]  # fmt: skip
        elif kind == "down_proj":
            parts = [tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(count)]
        else:
            raise KeyError(f"no checkpoint tensor for transformers' {key!r}")
        stacked = torch.stack(parts)
        if stacked.shape != current.shape:
            stacked = stacked.transpose(1, 2)
        state[key] = stacked.contiguous()
    return state
