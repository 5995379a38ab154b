"""dsmesh/bench/gpu.py on tiny shapes on CPU: every part runs and the JSON has the fields that
docs/BENCHMARKS.md reports (the numbers themselves mean nothing here)."""

from __future__ import annotations

import json

import pytest
import torch

from dsmesh.bench import gpu
from dsmesh.engine.model.config import ModelConfig


def test_shapes_are_the_released_configs() -> None:
    v2 = ModelConfig.from_dict(gpu.v2_lite_config())
    assert (v2.num_hidden_layers, v2.hidden_size, v2.vocab_size) == (27, 2048, 102400)
    assert (v2.moe.n_routed_experts, v2.moe.num_experts_per_tok, v2.moe.n_shared_experts) == (
        64,
        6,
        2,
    )
    assert (v2.intermediate_size, v2.moe.moe_intermediate_size, v2.mla.q_lora_rank) == (
        10944,
        1408,
        None,
    )
    v3 = ModelConfig.from_dict(gpu.v3_layers_config(2))
    assert (v3.hidden_size, v3.mla.num_heads, v3.mla.q_lora_rank, v3.mla.kv_lora_rank) == (
        7168,
        128,
        1536,
        512,
    )
    assert (v3.moe.n_routed_experts, v3.moe.num_experts_per_tok, v3.moe_layer_ids) == (
        256,
        8,
        [0, 1],
    )


def test_prefill_flops_and_bytes_by_hand() -> None:
    """One layer, one prompt of 2 tokens, tiny dims: counted by hand."""
    raw = gpu.v2_lite_config(tiny=True)
    raw.update(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=10)
    cfg = ModelConfig.from_dict(raw)
    h, heads, qk, c, r, nope, v, inter = 64, 4, 32, 32, 16, 16, 16, 128
    weights = h * heads * qk + h * (c + r) + c * heads * (nope + v) + heads * v * h + 3 * h * inter
    attention = 2 * 3 * heads * (qk + v)  # pairs (0,0), (1,0), (1,1)
    expected = 2 * weights * 2 + attention + 2 * h * 10
    assert gpu.prefill_flops(cfg, 2, 1) == pytest.approx(expected)
    model = gpu.build_dsmesh(gpu.v2_lite_config(tiny=True), torch.device("cpu"), torch.float32)
    one, many = gpu.weight_bytes_touched(model, 1), gpu.weight_bytes_touched(model, 10_000)
    per_expert = 3 * 64 * 32 * 4  # w13 + w2 of one expert, float32
    assert one["routed_experts"] == pytest.approx(2 * 2 * per_expert)  # 2 MoE layers, top-2
    assert many["routed_experts"] == pytest.approx(2 * 8 * per_expert)  # every expert
    assert many["other"] - one["other"] == pytest.approx((512 - 1) * 64 * 4)  # embedding rows


def test_tiny_run_writes_every_field(tmp_path) -> None:
    out = tmp_path / "results.json"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--batches", "1,3"]
    argv += ["--hf-batches", "3", "--context", "24", "--prompt-len", "16"]
    argv += ["--prefill-prompts", "2", "--steps", "2", "--repeats", "1", "--page-size", "8"]
    argv += ["--v3-batch", "2", "--v3-layers", "2"]
    gpu.main(argv)
    res = json.loads(out.read_text())
    assert "errors" not in res
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_TFLOPs"] > 0
    v2 = res["v2_lite"]
    assert v2["prefill"]["tokens_per_s"] > 0 and v2["prefill"]["matmul_fraction"] > 0
    assert [r["batch"] for r in v2["decode"]] == [1, 3]
    for row in v2["decode"]:
        assert row["kv_bytes"] == row["batch"] * 24 * 3 * (32 + 16) * 4
        for mode in ("graphs", "eager"):
            assert row[mode]["tokens_per_s"] > 0 and row[mode]["roofline_fraction"] > 0
    v3 = res["v3_layers"]
    assert v3["num_layers"] == 2 and v3["decode"]["batch"] == 2
    assert v3["prefill"]["seed_token_layers_per_s_per_gpu"] == 6500 * 61
    assert v3["decode"]["seed_token_layers_per_s_per_gpu"] == 2800 * 61
    (hf,) = res["transformers"]["rows"]
    assert hf["batch"] == 3 and hf["decode_tokens_per_s"] > 0 and hf["decode_speedup"] > 0
    assert set(res["targets"]) == {"decode_roofline", "prefill_matmul", "vs_transformers"}
    assert res["targets"]["decode_roofline"]["batch"] == 3


def test_v3_decode_with_each_kv_cache_dtype(tmp_path) -> None:
    """``--kv-cache-dtype auto,fp8_e4m3``: the V3 decode runs with the model-dtype cache, then
    again with an FP8 cache (its KV bytes: 48 one-byte values and 8 bytes of scales a token
    and layer at the tiny shape)."""
    out = tmp_path / "results.json"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--parts", "v3", "--context", "24"]
    argv += ["--prompt-len", "16", "--prefill-prompts", "2", "--steps", "2", "--page-size", "8"]
    argv += ["--v3-batch", "2", "--v3-layers", "2", "--kv-cache-dtype", "auto,fp8_e4m3"]
    gpu.main(argv)
    res = json.loads(out.read_text())
    assert "errors" not in res
    v3 = res["v3_layers"]
    assert v3["kv_cache_dtype"] == "auto"
    assert v3["decode"]["kv_bytes"] == 2 * 24 * 2 * (32 + 16) * 4
    fp8 = v3["decode"]["kv_fp8_e4m3"]
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and fp8["step_ms"] > 0
    assert fp8["kv_bytes"] == 2 * 24 * 2 * (32 + 16 + 8)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--kv-cache-dtype", "auto,int8"])
