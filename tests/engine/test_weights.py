"""Checkpoint loading: official tensor names, shards, strict name/shape checks, MTP layers, FP8.

FP8 tolerance. e4m3 keeps 3 mantissa bits, so round-to-nearest moves a weight by at most
2**-4 of its magnitude (plus 2**-10 of its block scale in the subnormal range), about 2.5%
RMS relative over a random matrix. That error is *not* small at the logits of these tiny
random models: their attention is sharp and their routing flips on small perturbations, so
any weight noise of that size is amplified (measured: ~35% relative logit error, whether the
noise is FP8 rounding or seeded Gaussian noise). A fixed bound such as 5e-2 would therefore
fail for a correct loader. The FP8 checks are instead:

- exact: every loaded weight equals the dequantised checkpoint value bit for bit, and the
  FP8-loaded model's logits equal those of a float32 checkpoint holding those values;
- statistical: FP8's logit error is no more than 1.5x that of multiplicative Gaussian weight
  noise with the same per-weight relative RMS (3 seeds), i.e. FP8 behaves like its own
  rounding and nothing else (a wrong scale layout or transposed block gives O(1) weight errors),
  and greedy argmax still agrees on most positions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.weights import (
    Fp8Weight,
    WeightError,
    official_state_dict,
    save_checkpoint_weights,
)
from dsmesh.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block
from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    edit_config,
    prefill_logits,
    random_prompts,
    relative_error,
)

FP8_BLOCK = (32, 32)
PROMPT_LENGTHS = [1, 2, 17, 64, 100]


def _prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, 256, seed)


def _logits(path: Path, **load_kwargs) -> torch.Tensor:
    return torch.cat(prefill_logits(load_model(path, **load_kwargs), _prompts(), "auto"))


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint folder with ``src``'s config.json and exactly ``tensors``."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _tensors(ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.path / "model.safetensors"))


# --------------------------------------------------------------------------------------------
# names and shards
# --------------------------------------------------------------------------------------------


def test_official_state_dict_round_trips_the_checkpoint(any_ckpt: HFCheckpoint) -> None:
    """Names written by transformers are exactly the names the engine reads and writes back."""
    tensors = _tensors(any_ckpt)
    ours = official_state_dict(load_model(any_ckpt.path))
    assert set(ours) == set(tensors)
    for name, value in tensors.items():
        assert torch.equal(ours[name], value), name


def test_sharded_checkpoint_loads_like_single_file(v3_ckpt: HFCheckpoint, tmp_path) -> None:
    tensors = official_state_dict(load_model(v3_ckpt.path))
    sharded = tmp_path / "sharded"
    save_checkpoint_weights(tensors, sharded, max_shard_bytes=64 * 1024)
    (sharded / "config.json").write_text((v3_ckpt.path / "config.json").read_text())

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert set(index["weight_map"]) == set(tensors)
    assert len(shard_files) >= 3
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == shard_files
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total

    single = tmp_path / "single"
    save_checkpoint_weights(tensors, single)
    (single / "config.json").write_text((v3_ckpt.path / "config.json").read_text())
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]

    reference = _logits(v3_ckpt.path)
    assert torch.equal(_logits(sharded), reference)
    assert torch.equal(_logits(single), reference)


def test_missing_shard_file_is_named(v3_ckpt: HFCheckpoint, tmp_path) -> None:
    path = tmp_path / "sharded"
    save_checkpoint_weights(_tensors(v3_ckpt), path, max_shard_bytes=64 * 1024)
    (path / "config.json").write_text((v3_ckpt.path / "config.json").read_text())
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(WeightError, match=re.escape(victim.name)):
        load_model(path)


# --------------------------------------------------------------------------------------------
# strictness: every error names the tensor
# --------------------------------------------------------------------------------------------

MISSING = [
    "model.layers.0.self_attn.q_a_proj.weight",
    "model.layers.2.mlp.experts.5.down_proj.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.shared_experts.up_proj.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize("name", MISSING)
def test_missing_tensor_raises_naming_it(v3_ckpt: HFCheckpoint, tmp_path, name: str) -> None:
    tensors = _tensors(v3_ckpt)
    del tensors[name]
    path = _rewrite(v3_ckpt.path, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightError, match=re.escape(repr(name))):
        load_model(path)


EXTRA = {
    "model.layers.0.self_attn.bogus_proj.weight": (8, 64),
    "model.layers.1.mlp.experts.8.gate_proj.weight": (32, 64),  # only experts 0..7 exist
    "model.layers.0.mlp.gate.weight": (8, 64),  # layer 0 is dense: no router
    "model.layers.0.mlp.experts.0.up_proj.weight": (32, 64),
    "model.final_norm.weight": (64,),
    # a block scale with no FP8 weight beside it (the weight is float32 here)
    "model.layers.0.self_attn.q_a_proj.weight_scale_inv": (1, 1),
    "model.layers.0.self_attn.bogus.weight_scale_inv": (1, 1),
}


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_unexpected_tensor_raises_naming_it(v3_ckpt: HFCheckpoint, tmp_path, name: str) -> None:
    tensors = _tensors(v3_ckpt)
    tensors[name] = torch.zeros(EXTRA[name])
    path = _rewrite(v3_ckpt.path, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightError, match=re.escape(repr(name))):
        load_model(path)


MISSHAPED = {
    "model.layers.0.self_attn.q_a_proj.weight": (64, 48),  # transposed [48, 64]
    "model.layers.1.self_attn.kv_b_proj.weight": (192, 48),
    "model.layers.2.mlp.experts.3.up_proj.weight": (32, 63),
    "model.layers.1.mlp.experts.0.down_proj.weight": (32, 64),  # transposed [64, 32]
    "model.layers.1.mlp.gate.e_score_correction_bias": (9,),
    "model.norm.weight": (65,),
}


@pytest.mark.parametrize("name", sorted(MISSHAPED))
def test_misshaped_tensor_raises_naming_it(v3_ckpt: HFCheckpoint, tmp_path, name: str) -> None:
    tensors = _tensors(v3_ckpt)
    tensors[name] = torch.zeros(MISSHAPED[name])
    path = _rewrite(v3_ckpt.path, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightError, match=re.escape(repr(name))):
        load_model(path)


def test_mtp_layer_tensors_are_skipped(v3_ckpt: HFCheckpoint, tmp_path) -> None:
    """DeepSeek-V3 ships its next-token-prediction module as layer ``num_hidden_layers``."""
    tensors = _tensors(v3_ckpt)
    mtp = "model.layers.3"
    gen = torch.Generator().manual_seed(0)
    extra_shapes = {
        f"{mtp}.eh_proj.weight": (64, 128),
        f"{mtp}.enorm.weight": (64,),
        f"{mtp}.hnorm.weight": (64,),
        f"{mtp}.embed_tokens.weight": (256, 64),
        f"{mtp}.shared_head.norm.weight": (64,),
        f"{mtp}.shared_head.head.weight": (256, 64),
        f"{mtp}.input_layernorm.weight": (64,),
        f"{mtp}.self_attn.q_a_proj.weight": (48, 64),
        f"{mtp}.mlp.gate.weight": (8, 64),
        f"{mtp}.mlp.gate.e_score_correction_bias": (8,),
        f"{mtp}.mlp.experts.0.gate_proj.weight": (32, 64),
        f"{mtp}.mlp.experts.7.down_proj.weight": (64, 32),
        f"{mtp}.mlp.shared_experts.up_proj.weight": (32, 64),
    }
    for name, shape in extra_shapes.items():
        tensors[name] = torch.randn(shape, generator=gen)
    path = _rewrite(v3_ckpt.path, tmp_path / "ckpt", tensors)
    edit_config(path, num_nextn_predict_layers=1)
    model = load_model(path)
    assert model.config.num_nextn_predict_layers == 1
    assert len(model.model.layers) == 3
    assert set(official_state_dict(model)) == set(_tensors(v3_ckpt))
    assert torch.equal(_logits(path), _logits(v3_ckpt.path))


# --------------------------------------------------------------------------------------------
# FP8 block-quantised checkpoints
# --------------------------------------------------------------------------------------------


def _quantised_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """As in DeepSeek-V3's release: every 2-D linear weight except embeddings, head, router."""
    return sorted(
        n
        for n, t in tensors.items()
        if t.dim() == 2
        and n not in ("model.embed_tokens.weight", "lm_head.weight")
        and not n.endswith("mlp.gate.weight")
    )


@pytest.fixture(scope="module")
def fp8_ckpt(v3_ckpt: HFCheckpoint, tmp_path_factory: pytest.TempPathFactory):
    """(path, source tensors, stored tensors, quantised names) of an FP8 copy of ``v3_ckpt``."""
    source = _tensors(v3_ckpt)
    names = _quantised_names(source)
    stored = dict(source)
    for name in names:
        q, scale_inv = quantize_fp8_block(source[name], FP8_BLOCK)
        stored[name] = q
        stored[name + "_scale_inv"] = scale_inv
    path = _rewrite(v3_ckpt.path, tmp_path_factory.mktemp("fp8") / "ckpt", stored)
    edit_config(
        path,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(FP8_BLOCK),
            "activation_scheme": "dynamic",
        },
    )
    return path, source, stored, names


def test_fp8_checkpoint_has_what_deepseek_ships(fp8_ckpt) -> None:
    _, source, stored, names = fp8_ckpt
    # 3 layers x 5 attention matrices + dense MLP (3) + 2 MoE layers x (8 experts + shared) x 3
    assert len(names) == 15 + 3 + 2 * 9 * 3
    assert "model.layers.0.self_attn.q_a_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" not in names
    assert stored["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    # q_a_proj is [48, 64]: the second row block is ragged (16 rows).
    assert stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (2, 2)


def test_fp8_weights_load_as_dequantised_values(fp8_ckpt) -> None:
    path, source, stored, names = fp8_ckpt
    model = load_model(path, keep_fp8=True)
    assert model.config.quant is not None
    assert model.config.quant.weight_block_size == FP8_BLOCK
    loaded = official_state_dict(model)
    for name in names:
        q, scale_inv = stored[name], stored[name + "_scale_inv"]
        expected = dequantize_fp8_block(q, scale_inv, FP8_BLOCK)
        assert torch.equal(loaded[name], expected), name
        # ... and that is the source up to e4m3 rounding: half an ulp of 3 mantissa bits,
        # or half the subnormal step 2**-9 in units of the block scale.
        scale = scale_inv.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
        scale = scale[: q.shape[0], : q.shape[1]]
        bound = (2**-4 * source[name].abs() + 2**-10 * scale) * (1 + 1e-5)
        assert bool(((loaded[name] - source[name]).abs() <= bound).all()), name
    for name in set(source) - set(names):
        assert torch.equal(loaded[name], source[name]), name
    rms = torch.stack([(loaded[n] - source[n]).norm() / source[n].norm() for n in names])
    assert 0.01 < float(rms.mean()) < 0.04  # e4m3 rounding: ~2.5% relative


def test_fp8_data_is_kept_for_the_gpu_path(fp8_ckpt) -> None:
    path, _, stored, names = fp8_ckpt
    model = load_model(path, keep_fp8=True)
    assert set(model.fp8_weights) == set(names)
    for name in (
        "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.2.mlp.experts.6.gate_proj.weight",
        "model.layers.2.mlp.experts.6.down_proj.weight",
    ):
        kept = model.fp8_weights[name]
        assert isinstance(kept, Fp8Weight)
        assert kept.data.dtype == torch.float8_e4m3fn
        assert torch.equal(kept.data.view(torch.uint8), stored[name].view(torch.uint8))
        assert torch.equal(kept.scale_inv, stored[name + "_scale_inv"])
        assert tuple(kept.block_size) == FP8_BLOCK
    assert load_model(path).fp8_weights == {}


def test_fp8_model_equals_float_model_with_dequantised_weights(fp8_ckpt, tmp_path) -> None:
    path, _, stored, names = fp8_ckpt
    dense = {n: t for n, t in stored.items() if not n.endswith("_scale_inv")}
    for name in names:
        dense[name] = dequantize_fp8_block(stored[name], stored[name + "_scale_inv"], FP8_BLOCK)
    dense_path = _rewrite(path, tmp_path / "dense", dense)
    edit_config(dense_path, quantization_config=None)
    assert torch.equal(_logits(path, keep_fp8=True), _logits(dense_path))


def _fp8_relative_rms(
    source: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], names: list[str]
) -> float:
    """Mean over quantised weights of ||dequant(q) - w|| / ||w||."""
    errs = []
    for n in names:
        dense = dequantize_fp8_block(stored[n], stored[n + "_scale_inv"], FP8_BLOCK)
        errs.append(float((dense - source[n]).norm() / source[n].norm()))
    return sum(errs) / len(errs)


def _noisy_logits(
    ckpt: HFCheckpoint, names: list[str], rel_rms: float, seed: int, out_dir: Path
) -> torch.Tensor:
    """Logits with every quantised weight multiplied by (1 + rel_rms * N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    tensors = _tensors(ckpt)
    for name in names:
        noise = torch.randn(tensors[name].shape, generator=gen)
        tensors[name] = tensors[name] * (1 + rel_rms * noise)
    return _logits(_rewrite(ckpt.path, out_dir, tensors))


def test_fp8_logits_within_quantisation_tolerance(
    v3_ckpt: HFCheckpoint, fp8_ckpt, tmp_path
) -> None:
    path, source, stored, names = fp8_ckpt
    reference = _logits(v3_ckpt.path)
    fp8 = _logits(path, keep_fp8=True)
    fp8_err = float((fp8 - reference).norm() / reference.norm())

    rel_rms = _fp8_relative_rms(source, stored, names)
    noise_errs = []
    for seed in range(3):
        noisy = _noisy_logits(v3_ckpt, names, rel_rms, seed, tmp_path / f"noise{seed}")
        noise_errs.append(float((noisy - reference).norm() / reference.norm()))

    assert 1e-3 < fp8_err <= 1.5 * max(noise_errs), (fp8_err, noise_errs)
    assert relative_error(fp8, reference) < 1.0
    agree = float((fp8.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agree >= 0.55, agree


def test_fp8_tensor_without_scale_is_named(fp8_ckpt, tmp_path) -> None:
    path, _, stored, _ = fp8_ckpt
    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    tensors = dict(stored)
    del tensors[name + "_scale_inv"]
    broken = _rewrite(path, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightError, match=re.escape(name + "_scale_inv")):
        load_model(broken)


def test_fp8_scale_of_wrong_shape_is_named(fp8_ckpt, tmp_path) -> None:
    path, _, stored, _ = fp8_ckpt
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    tensors = dict(stored)
    tensors[name] = torch.ones(1, 1)
    broken = _rewrite(path, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightError, match=re.escape(name)):
        load_model(broken)


def test_engine_fp8_experts_switch_keeps_fp8_data_and_tokens(fp8_ckpt) -> None:
    """``EngineConfig.fp8_experts`` (``--fp8-experts``) loads with the FP8 data kept; on the
    CPU the dense path runs, with the same greedy tokens as a plain load."""
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.sampling.params import SamplingParams

    path, _, _, names = fp8_ckpt
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kept = LLMEngine(EngineConfig(model=str(path), fp8_experts=True))
    plain = LLMEngine(EngineConfig(model=str(path)))
    assert set(kept.model.fp8_weights) == set(names) and plain.model.fp8_weights == {}
    prompts = [[5, 9, 14, 2], [7] * 11]
    assert [r.output_ids for r in kept.generate(prompts, params)] == [
        r.output_ids for r in plain.generate(prompts, params)
    ]
