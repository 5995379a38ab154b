"""Tests for dsmesh.engine.model.config: both config.json spellings, real DeepSeek configs, and
errors."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest

from dsmesh.engine.model.config import ConfigError, ModelConfig, load_config
from tests.engine.hf_checkpoints import v2_config, v3_config

# DeepSeek-V3's config.json as released (auto_map dropped).
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# DeepSeek-V2-Lite's config.json as released (auto_map dropped).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

# The tiny V3 of tests/engine/hf_checkpoints.py, written by hand in the official spelling.
TINY_V3_OFFICIAL: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}


def _transformers_dict(hf_config) -> dict[str, Any]:
    """What transformers 5 writes to config.json (``rope_parameters``, no topk_method...)."""
    return json.loads(hf_config.to_json_string())


def test_official_and_transformers_spellings_parse_equal() -> None:
    hf = _transformers_dict(v3_config())
    assert "rope_parameters" in hf and "rope_scaling" not in hf and "topk_method" not in hf
    assert ModelConfig.from_dict(hf) == ModelConfig.from_dict(TINY_V3_OFFICIAL)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("yarn", [True, False])
def test_v2_spellings_parse_equal(topk_method: str, yarn: bool) -> None:
    hf = _transformers_dict(v2_config(topk_method=topk_method, yarn=yarn))
    official = {k: v for k, v in hf.items() if k not in ("rope_parameters", "head_dim")}
    params = hf["rope_parameters"]
    official["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    official["rope_scaling"] = {"type": "yarn", **scaling} if yarn else None
    official.update(scoring_func="softmax", moe_layer_freq=1)
    cfg = ModelConfig.from_dict(hf)
    assert cfg == ModelConfig.from_dict(official)
    assert cfg.rope.scaling == ("yarn" if yarn else "none")
    assert cfg.moe.topk_method == topk_method
    assert cfg.moe.n_group == (4 if topk_method == "group_limited_greedy" else 1)


def test_parsed_tiny_v3_fields() -> None:
    cfg = ModelConfig.from_dict(TINY_V3_OFFICIAL)
    assert cfg.mla.q_lora_rank == 48
    assert cfg.mla.qk_head_dim == 32
    assert cfg.mla.kv_cache_dim == 48
    assert cfg.rope.scaling == "yarn" and cfg.rope.factor == 4.0
    assert cfg.rope.original_max_position_embeddings == 64
    assert cfg.rope.interleave
    assert cfg.moe_layer_ids == [1, 2]
    assert cfg.eos_token_ids == (1,)
    assert cfg.quant is None


def test_v2_lite_official_config() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    assert cfg.model_type == "deepseek_v2"
    assert cfg.mla.q_lora_rank is None
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim) == (
        512,
        128,
        64,
    )
    assert cfg.mla.kv_cache_dim == 576
    moe = cfg.moe
    assert (moe.topk_method, moe.scoring_func) == ("greedy", "softmax")
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts) == (64, 6, 2)
    assert moe.norm_topk_prob is False
    assert moe.first_k_dense_replace == 1
    assert (moe.n_group, moe.topk_group) == (1, 1)
    assert moe.routed_scaling_factor == 1.0
    assert cfg.moe_layer_ids == list(range(1, 27))
    assert cfg.rope.scaling == "yarn"
    assert (cfg.rope.factor, cfg.rope.mscale, cfg.rope.mscale_all_dim) == (40.0, 0.707, 0.707)
    assert cfg.rope.original_max_position_embeddings == 4096
    assert cfg.eos_token_ids == (100001,)
    assert cfg.quant is None
    # mscale_all_dim 0.707 at factor 40: (0.1 * 0.707 * ln 40 + 1) ** 2 = 1.58963, / sqrt(192)
    assert cfg.softmax_scale == pytest.approx(1.589626 / math.sqrt(192), rel=1e-6)
    assert cfg.softmax_scale == pytest.approx(0.1147214, rel=1e-6)


def test_full_size_deepseek_v3_config() -> None:
    cfg = ModelConfig.from_dict(copy.deepcopy(DEEPSEEK_V3))
    assert cfg.mla.kv_cache_dim == 576
    assert cfg.mla.qk_head_dim == 192
    assert cfg.mla.q_lora_rank == 1536
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (61, 7168, 129280)
    assert cfg.num_nextn_predict_layers == 1
    moe = cfg.moe
    assert (moe.topk_method, moe.scoring_func, moe.norm_topk_prob) == ("noaux_tc", "sigmoid", True)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_group, moe.topk_group) == (
        256,
        8,
        8,
        4,
    )
    assert moe.routed_scaling_factor == 2.5
    assert cfg.moe_layer_ids == list(range(3, 61))
    assert cfg.quant is not None
    assert (cfg.quant.method, cfg.quant.fmt, cfg.quant.weight_block_size) == (
        "fp8",
        "e4m3",
        (128, 128),
    )
    assert cfg.rope.factor == 40.0 and cfg.rope.mscale_all_dim == 1.0
    mscale = 0.1 * 1.0 * math.log(40) + 1  # 1.368888
    assert cfg.softmax_scale == pytest.approx(mscale**2 / math.sqrt(192), rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(0.1352338, rel=1e-6)
    # the official writer round-trips
    assert ModelConfig.from_dict(cfg.to_official_dict()) == cfg


def test_load_config_reads_the_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    assert load_config(tmp_path) == ModelConfig.from_dict(DEEPSEEK_V3)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("first_k", "freq", "num_layers", "expected"),
    [
        (0, 1, 4, [0, 1, 2, 3]),
        (1, 1, 4, [1, 2, 3]),
        (3, 1, 5, [3, 4]),
        (3, 2, 10, [4, 6, 8]),
        (0, 3, 7, [0, 3, 6]),
        (5, 1, 4, []),
    ],
)
def test_is_moe_layer(first_k: int, freq: int, num_layers: int, expected: list[int]) -> None:
    raw = dict(
        TINY_V3_OFFICIAL,
        first_k_dense_replace=first_k,
        moe_layer_freq=freq,
        num_hidden_layers=num_layers,
    )
    cfg = ModelConfig.from_dict(raw)
    assert cfg.moe_layer_ids == expected
    assert [cfg.is_moe_layer(i) for i in range(num_layers)] == [
        i in expected for i in range(num_layers)
    ]


def test_no_routed_experts_means_all_dense() -> None:
    cfg = ModelConfig.from_dict(dict(TINY_V3_OFFICIAL, n_routed_experts=0))
    assert cfg.moe_layer_ids == []


def test_softmax_scale_by_hand() -> None:
    # tiny V3: qk_head_dim 32, yarn factor 4, mscale_all_dim 0.707
    mscale = 0.1 * 0.707 * math.log(4.0) + 1.0
    cfg = ModelConfig.from_dict(TINY_V3_OFFICIAL)
    assert cfg.softmax_scale == pytest.approx(mscale * mscale / math.sqrt(32), rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(0.2131270, rel=1e-6)
    plain = ModelConfig.from_dict(dict(TINY_V3_OFFICIAL, rope_scaling=None))
    assert plain.softmax_scale == pytest.approx(1 / math.sqrt(32), rel=1e-12)
    # yarn without mscale_all_dim: no correction
    no_all_dim = copy.deepcopy(TINY_V3_OFFICIAL)
    del no_all_dim["rope_scaling"]["mscale_all_dim"]
    assert ModelConfig.from_dict(no_all_dim).softmax_scale == pytest.approx(1 / math.sqrt(32))


_DELETE = object()


def _with(**changes: Any) -> dict[str, Any]:
    """TINY_V3_OFFICIAL with fields changed, or removed where the value is ``_DELETE``."""
    raw = copy.deepcopy(TINY_V3_OFFICIAL)
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_with(model_type="llama"), "model_type"),
        (_with(model_type=_DELETE), "model_type"),
        (_with(kv_lora_rank=_DELETE), "kv_lora_rank"),
        (_with(hidden_size=_DELETE), "hidden_size"),
        (_with(num_attention_heads=None), "num_attention_heads"),
        (_with(topk_method="random_choice"), "topk_method"),
        (_with(scoring_func="relu"), "scoring_func"),
        (_with(n_group=3), "n_group"),
        (_with(topk_group=5), "topk_group"),
        (_with(num_experts_per_tok=9), "num_experts_per_tok"),
        (_with(topk_method="noaux_tc", scoring_func="softmax"), "noaux_tc"),
        (_with(hidden_act="gelu"), "hidden_act"),
        (_with(qk_rope_head_dim=15), "qk_rope_head_dim"),
        (_with(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope scaling"),
        (_with(rope_scaling={"type": "yarn"}), "factor"),
        (_with(quantization_config={"quant_method": "gptq"}), "quant_method"),
        (_with(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}), "fmt"),
    ],
)
def test_bad_config_raises_naming_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        ModelConfig.from_dict(raw)


def test_v2_needs_one_kv_head_per_query_head() -> None:
    raw = dict(DEEPSEEK_V2_LITE, num_key_value_heads=8)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_dict(raw)
