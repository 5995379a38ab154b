"""The model's shape as the performance model needs it: parameter counts, KV bytes and FLOPs
per token, from a checkpoint's ``config.json`` or a named preset.

Counts are per layer unless named otherwise; bytes assume the stored precision (FP8 weights
1 byte, bf16 2). The KV cache is bf16 (MLA's latent plus the shared rope key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from dsmesh.engine.model.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """A DeepSeek-V2/V3 model reduced to what costs time and memory."""

    name: str
    num_layers: int
    num_dense_layers: int  # the first layers, whose FFN is dense
    hidden: int
    num_heads: int
    q_lora_rank: int  # 0: q projected straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    num_experts: int  # routed, per MoE layer
    experts_per_token: int
    num_shared_experts: int
    moe_inter: int
    dense_inter: int
    vocab: int
    num_groups: int  # expert groups of node-limited routing (1: none)
    groups_per_token: int
    mtp_layers: int
    expert_bytes: float  # bytes per routed-expert weight (1: FP8)
    weight_bytes: float  # bytes per other weight
    kv_bytes: float = 2.0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_params(self) -> int:
        """q (through its LoRA when present), kv_a, kv_b and o projections of one layer."""
        qk = self.num_heads * (self.qk_nope_dim + self.qk_rope_dim)
        q = (
            self.hidden * self.q_lora_rank + self.q_lora_rank * qk
            if self.q_lora_rank
            else self.hidden * qk
        )
        kv_a = self.hidden * (self.kv_lora_rank + self.qk_rope_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * self.hidden
        return q + kv_a + kv_b + o

    @property
    def expert_params(self) -> int:
        """gate, up and down of one routed (or shared) expert."""
        return 3 * self.hidden * self.moe_inter

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_inter

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token holds over all layers."""
        return self.kv_dim * self.kv_bytes * self.num_layers

    def decode_attn_flops(self, context: float) -> float:
        """Absorbed MLA decode FLOPs of one token at ``context`` cached tokens, one layer:
        2·H·L·(latent + rope) for the scores and 2·H·L·latent for the values."""
        return 2.0 * self.num_heads * context * (self.kv_dim + self.kv_lora_rank)

    def prefill_attn_flops(self, new: float, cached: float) -> float:
        """Naive (per-head) causal MLA prefill FLOPs of ``new`` tokens after ``cached``, one
        layer: 2·H·(qk + v)·(new·cached + new²/2)."""
        qkv = self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim
        return 2.0 * self.num_heads * qkv * (new * cached + new * new / 2.0)

    def weight_bytes_total(self) -> float:
        """Every weight of the model (no MTP layer), as stored."""
        moe = self.num_moe_layers * (
            self.num_experts * self.expert_params * self.expert_bytes
            + self.num_shared_experts * self.expert_params * self.weight_bytes
        )
        dense = self.num_dense_layers * self.dense_ffn_params * self.weight_bytes
        attn = self.num_layers * self.attn_params * self.weight_bytes
        return moe + dense + attn + 2 * self.vocab * self.hidden * self.weight_bytes


V3 = ModelShape(
    name="deepseek-v3", num_layers=61, num_dense_layers=3, hidden=7168, num_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
    num_experts=256, experts_per_token=8, num_shared_experts=1, moe_inter=2048,
    dense_inter=18432, vocab=129280, num_groups=8, groups_per_token=4, mtp_layers=1,
    expert_bytes=1.0, weight_bytes=1.0,
)  # fmt: skip
V2 = ModelShape(
    name="deepseek-v2", num_layers=60, num_dense_layers=1, hidden=5120, num_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
    num_experts=160, experts_per_token=6, num_shared_experts=2, moe_inter=1536,
    dense_inter=12288, vocab=102400, num_groups=8, groups_per_token=3, mtp_layers=0,
    expert_bytes=2.0, weight_bytes=2.0,
)  # fmt: skip
V2_LITE = ModelShape(
    name="deepseek-v2-lite", num_layers=27, num_dense_layers=1, hidden=2048, num_heads=16,
    q_lora_rank=0, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
    num_experts=64, experts_per_token=6, num_shared_experts=2, moe_inter=1408,
    dense_inter=10944, vocab=102400, num_groups=1, groups_per_token=1, mtp_layers=0,
    expert_bytes=2.0, weight_bytes=2.0,
)  # fmt: skip

PRESETS: dict[str, ModelShape] = {
    "v3": V3,
    "r1": replace(V3, name="deepseek-r1"),
    "v2": V2,
    "v2-lite": V2_LITE,
}


def shape_from_config(config: ModelConfig, name: str = "checkpoint") -> ModelShape:
    """The shape of a parsed ``config.json``: FP8 checkpoints store every linear weight in
    FP8 (1 byte), others in bf16."""
    moe, mla = config.moe, config.mla
    nbytes = 1.0 if config.quant is not None else 2.0
    return ModelShape(
        name=name,
        num_layers=config.num_hidden_layers,
        num_dense_layers=min(moe.first_k_dense_replace, config.num_hidden_layers)
        if moe.n_routed_experts
        else config.num_hidden_layers,
        hidden=config.hidden_size,
        num_heads=mla.num_heads,
        q_lora_rank=mla.q_lora_rank or 0,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_dim=mla.qk_nope_head_dim,
        qk_rope_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        num_experts=moe.n_routed_experts,
        experts_per_token=moe.num_experts_per_tok,
        num_shared_experts=moe.n_shared_experts,
        moe_inter=moe.moe_intermediate_size,
        dense_inter=config.intermediate_size,
        vocab=config.vocab_size,
        num_groups=moe.n_group,
        groups_per_token=moe.topk_group,
        mtp_layers=config.num_nextn_predict_layers,
        expert_bytes=nbytes,
        weight_bytes=nbytes,
    )


def resolve_shape(model: str) -> ModelShape:
    """A preset name (``v3``, ``r1``, ``v2``, ``v2-lite``), a checkpoint folder or its
    ``config.json``."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint "
            "folder or config.json"
        )
    try:
        config = ModelConfig.from_dict(json.loads(path.read_text()))
    except (ConfigError, json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"--model: {path}: {exc}") from exc
    return shape_from_config(config, name=path.parent.name or "checkpoint")
