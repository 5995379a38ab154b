"""Session-wide tiny transformers checkpoints, built once and shared by every engine test.

Tests must treat these folders and models as read-only; a test that needs a modified
checkpoint works on ``copy_checkpoint(...)`` of it.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    add_mtp_layer,
    make_fp8_copy,
    make_hf_v2,
    make_hf_v3,
)


@pytest.fixture(scope="session")
def v3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V3: q_lora_rank 48, YaRN, noaux_tc routing with a random correction bias."""
    return HFCheckpoint(*make_hf_v3(tmp_path_factory.mktemp("v3"), seed=0))


@pytest.fixture(scope="session")
def v3_plain_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V3 without q LoRA (``q_proj``) and with plain RoPE."""
    return HFCheckpoint(
        *make_hf_v3(tmp_path_factory.mktemp("v3_plain"), q_lora_rank=None, yarn=False, seed=1)
    )


@pytest.fixture(scope="session")
def v2_greedy_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V2-Lite-like: q_lora_rank None, greedy softmax routing, YaRN."""
    return HFCheckpoint(*make_hf_v2(tmp_path_factory.mktemp("v2_greedy"), seed=2))


@pytest.fixture(scope="session")
def v2_grouped_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V2: group_limited_greedy routing (4 groups of 2 experts, best 2 groups kept), YaRN."""
    return HFCheckpoint(
        *make_hf_v2(
            tmp_path_factory.mktemp("v2_grouped"), topk_method="group_limited_greedy", seed=3
        )
    )


@pytest.fixture(scope="session")
def v3_fp8_ckpt(v3_ckpt: HFCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """``v3_ckpt`` as DeepSeek-V3 ships it: every linear weight (attention projections, dense
    MLP, shared and routed experts) in FP8 with 128 x 128 block scales; its transformers
    model holds the dequantised weights."""
    return make_fp8_copy(v3_ckpt, tmp_path_factory.mktemp("v3_fp8") / "ckpt")


@pytest.fixture(params=["v3_ckpt", "v3_plain_ckpt", "v2_greedy_ckpt", "v2_grouped_ckpt"])
def any_ckpt(request: pytest.FixtureRequest) -> HFCheckpoint:
    """Each of the four checkpoints in turn."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def v2_latent_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V2 with DeepSeek's real latent widths (kv_lora_rank 512, rope 64): the shape
    FlashInfer's MLA kernels are built for."""
    path = tmp_path_factory.mktemp("v2_latent")
    return HFCheckpoint(*make_hf_v2(path, seed=4, kv_lora_rank=512, qk_rope_head_dim=64))


@pytest.fixture(scope="session")
def v3_mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V3 with one MTP layer (random weights, MoE like the official layer 61)."""
    model, path = make_hf_v3(tmp_path_factory.mktemp("v3_mtp"), seed=5)
    add_mtp_layer(path, seed=6)
    return HFCheckpoint(model, path)


@pytest.fixture(scope="session")
def v3_mtp_small_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """V3 with one MTP layer and a vocabulary of 4 tokens, for distribution tests."""
    model, path = make_hf_v3(tmp_path_factory.mktemp("v3_mtp_vocab4"), seed=7, vocab_size=4)
    add_mtp_layer(path, seed=8)
    return HFCheckpoint(model, path)
