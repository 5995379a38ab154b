"""Model configuration read from a checkpoint's ``config.json``.

Two spellings are accepted for the same architecture:

- the official DeepSeek one (``rope_theta`` + ``rope_scaling: {type: yarn, ...}``, ``topk_method``,
  ``scoring_func``, ``moe_layer_freq``), as shipped with DeepSeek-V2/V3/R1;
- the transformers 5.x one (``rope_parameters: {rope_type, rope_theta, ...}``), as written by
  ``save_pretrained``.

Every architectural switch is a field here; model code never branches on a dimension size.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be served; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    """Decoupled RoPE on the ``qk_rope_head_dim`` channels, optionally YaRN-scaled."""

    theta: float = 10000.0
    scaling: str = "none"  # "none" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleave: bool = True  # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dimensions."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeekMoE: routed experts, shared experts, and which layers are sparse."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    topk_method: str
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int = 1


@dataclass(frozen=True)
class QuantConfig:
    """Block-scaled FP8 weights (``weight_scale_inv`` beside each quantised weight)."""

    method: str = "fp8"
    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    """Everything that shapes a DeepSeek-V2/V3 model, read once from the checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int
    mla: MLAConfig
    moe: MoEConfig
    rope: RopeConfig
    quant: QuantConfig | None = None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Official rule: sparse from ``first_k_dense_replace`` on, every ``moe_layer_freq``."""
        moe = self.moe
        return (
            moe.n_routed_experts > 0
            and layer_idx >= moe.first_k_dense_replace
            and layer_idx % moe.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)**2 under YaRN."""
        scale = self.mla.qk_head_dim**-0.5
        rope = self.rope
        if rope.scaling == "yarn" and rope.mscale_all_dim:
            m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(raw)

    def to_official_dict(self) -> dict[str, Any]:
        """The official DeepSeek ``config.json`` spelling of this config."""
        mla, moe, rope = self.mla, self.moe, self.rope
        out: dict[str, Any] = {
            "architectures": [_ARCH[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "num_attention_heads": mla.num_heads,
            "num_key_value_heads": mla.num_heads,
            "n_shared_experts": moe.n_shared_experts,
            "n_routed_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "topk_method": moe.topk_method,
            "scoring_func": moe.scoring_func,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "norm_topk_prob": moe.norm_topk_prob,
            "first_k_dense_replace": moe.first_k_dense_replace,
            "moe_layer_freq": moe.moe_layer_freq,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "attention_bias": mla.attention_bias,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": rope.theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            ),
        }
        if rope.scaling == "yarn":
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": rope.factor,
                "original_max_position_embeddings": rope.original_max_position_embeddings,
                "beta_fast": rope.beta_fast,
                "beta_slow": rope.beta_slow,
                "mscale": rope.mscale,
                "mscale_all_dim": rope.mscale_all_dim,
            }
        if not rope.interleave:
            out["rope_interleave"] = False
        if self.quant is not None:
            q = asdict(self.quant)
            out["quantization_config"] = {
                "quant_method": q["method"],
                "fmt": q["fmt"],
                "weight_block_size": list(q["weight_block_size"]),
                "activation_scheme": q["activation_scheme"],
            }
        return out


_ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature: 0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def load_config(checkpoint_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint folder."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {checkpoint_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return _parse(raw)


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"config.json: required field '{key}' is missing")
    return raw[key]


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json: unsupported model_type {model_type!r}; "
            f"dsmesh serves {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    is_v3 = model_type == "deepseek_v3"
    num_heads = int(_require(raw, "num_attention_heads"))
    kv_heads = raw.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != num_heads and not is_v3:
        # MLA has no grouped KV heads; V3 configs carry a meaningless copy of the head count.
        raise ConfigError(
            f"config.json: num_key_value_heads ({kv_heads}) must equal num_attention_heads "
            f"({num_heads}) for MLA"
        )
    mla = MLAConfig(
        num_heads=num_heads,
        q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
        kv_lora_rank=int(_require(raw, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_require(raw, "qk_rope_head_dim")),
        v_head_dim=int(_require(raw, "v_head_dim")),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    moe = _parse_moe(raw, is_v3)
    rope = _parse_rope(raw)
    eos = raw.get("eos_token_id")
    eos_ids: tuple[int, ...] = (
        () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    )
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=int(_require(raw, "hidden_size")),
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_hidden_layers=int(_require(raw, "num_hidden_layers")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=int(
            raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0
        ),
        mla=mla,
        moe=moe,
        rope=rope,
        quant=_parse_quant(raw.get("quantization_config")),
    )
    _validate(cfg)
    return cfg


def _parse_moe(raw: dict[str, Any], is_v3: bool) -> MoEConfig:
    n_routed = int(raw.get("n_routed_experts") or 0)
    topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
    scoring = raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax")
    default_norm = is_v3
    norm = raw.get("norm_topk_prob")
    return MoEConfig(
        n_routed_experts=n_routed,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        topk_method=str(topk_method),
        scoring_func=str(scoring),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=default_norm if norm is None else bool(norm),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
    )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if isinstance(params, dict) and params:
        # transformers 5.x: one dict holds theta and scaling alike.
        spec = dict(params)
        theta = spec.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        spec = dict(scaling) if isinstance(scaling, dict) else {}
        theta = raw.get("rope_theta", 10000.0)
    kind = spec.get("rope_type", spec.get("type", "default")) or "default"
    interleave = bool(raw.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(theta=float(theta), interleave=interleave)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported (only yarn)")
    if "factor" not in spec:
        raise ConfigError("config.json: rope_scaling.factor is required for yarn")
    return RopeConfig(
        theta=float(theta),
        scaling="yarn",
        factor=float(spec["factor"]),
        original_max_position_embeddings=int(
            spec.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
        ),
        beta_fast=float(spec.get("beta_fast") or 32),
        beta_slow=float(spec.get("beta_slow") or 1),
        mscale=float(spec.get("mscale") if spec.get("mscale") is not None else 1.0),
        mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
        interleave=interleave,
    )


def _parse_quant(raw: Any) -> QuantConfig | None:
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} unsupported")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config.json: quantization_config.fmt {fmt!r} unsupported (e4m3 only)")
    block = raw.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ConfigError("config.json: quantization_config.weight_block_size must have 2 entries")
    return QuantConfig(
        weight_block_size=(int(block[0]), int(block[1])),
        activation_scheme=str(raw.get("activation_scheme", "dynamic")),
    )


def _validate(cfg: ModelConfig) -> None:
    moe = cfg.moe
    positive = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.mla.num_heads,
        "kv_lora_rank": cfg.mla.kv_lora_rank,
        "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
        "v_head_dim": cfg.mla.v_head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config.json: {name} must be > 0, got {value}")
    if cfg.mla.qk_rope_head_dim % 2:
        raise ConfigError("config.json: qk_rope_head_dim must be even")
    if cfg.hidden_act != "silu":
        raise ConfigError(f"config.json: hidden_act {cfg.hidden_act!r} unsupported (silu only)")
    if moe.n_routed_experts == 0:
        return
    if moe.topk_method not in TOPK_METHODS:
        raise ConfigError(
            f"config.json: topk_method {moe.topk_method!r} unsupported; use one of {TOPK_METHODS}"
        )
    if moe.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"config.json: scoring_func {moe.scoring_func!r} unsupported")
    if moe.topk_method == "noaux_tc" and moe.scoring_func != "sigmoid":
        raise ConfigError("config.json: topk_method noaux_tc needs scoring_func sigmoid")
    if not (0 < moe.num_experts_per_tok <= moe.n_routed_experts):
        raise ConfigError(
            f"config.json: num_experts_per_tok must be in [1, n_routed_experts], "
            f"got {moe.num_experts_per_tok}"
        )
    if moe.moe_intermediate_size <= 0:
        raise ConfigError("config.json: moe_intermediate_size must be > 0 for an MoE model")
    if moe.n_routed_experts % moe.n_group:
        raise ConfigError(
            f"config.json: n_routed_experts ({moe.n_routed_experts}) must divide by n_group "
            f"({moe.n_group})"
        )
    if not (1 <= moe.topk_group <= moe.n_group):
        raise ConfigError(f"config.json: topk_group must be in [1, n_group], got {moe.topk_group}")
    if moe.moe_layer_freq < 1:
        raise ConfigError("config.json: moe_layer_freq must be >= 1")
