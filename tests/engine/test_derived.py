"""Defaults derived from the device, the model and the role (dsmesh/engine/derived.py), with
fake device sizes: an H200 (143,771 MiB), an 80 GB GPU and a CPU."""

from __future__ import annotations

import pytest

from dsmesh.bench.checkpoint import shape_config
from dsmesh.engine.derived import (
    DeviceFacts,
    MemoryPlanError,
    check_weights_fit,
    derive,
    headroom_bytes,
)
from dsmesh.engine.footprint import activation_bytes
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.options import EngineConfig

MIB = 1 << 20
H200 = DeviceFacts("cuda", 143771 * MIB, fp8_kernels=True)
GPU_80 = DeviceFacts("cuda", 81559 * MIB, fp8_kernels=True)
CPU = DeviceFacts("cpu")


def shape(name: str) -> ModelConfig:
    return ModelConfig.from_dict(shape_config(name))


def test_cpu_keeps_small_limits() -> None:
    d = derive(EngineConfig(role="unified"), shape("tiny"), CPU)
    c = d.config
    assert (c.max_running_requests, c.max_batch_tokens, c.cuda_graph_max_batch) == (64, 2048, 64)
    assert c.prefix_cache is True and c.fp8_experts is False
    assert c.is_resolved
    assert set(d.reasons) == {
        "max_running_requests", "max_batch_tokens", "cuda_graph_max_batch", "prefix_cache",
        "fp8_experts", "fp8_linears",
    }  # fmt: skip
    assert c.fp8_linears is False


@pytest.mark.parametrize("role", ["prefill", "decode", "unified"])
def test_v2_lite_on_an_h200_gets_the_tuned_limits(role: str) -> None:
    """What was hand-tuned on the H200 for V2-Lite (256 running requests, 16,384-token
    batches), with prefill and decode sharing the GPU (0.425 each) or a unified alone."""
    share = 0.85 if role == "unified" else 0.425
    c = derive(EngineConfig(role=role, mem_fraction=share), shape("v2-lite"), H200).config
    assert (c.max_running_requests, c.max_batch_tokens) == (256, 16384)
    assert c.cuda_graph_max_batch == 256
    assert c.prefix_cache is True


def test_v3_layers_sharing_a_gpu_take_smaller_chunks_where_graphs_need_room() -> None:
    mc = shape("v3-layers")
    decode = derive(EngineConfig(role="decode", mem_fraction=0.425), mc, H200).config
    prefill = derive(
        EngineConfig(role="prefill", mem_fraction=0.425, cuda_graphs=False), mc, H200
    ).config
    assert decode.max_batch_tokens == 8192 and prefill.max_batch_tokens == 16384
    assert decode.fp8_experts is True  # an FP8 checkpoint on CUDA
    assert decode.fp8_linears is True  # as --fp8-experts
    room = headroom_bytes(H200.total_bytes, 0.425)
    assert activation_bytes(mc, 16384, 2, 256) <= room < activation_bytes(mc, 16384, 2, 256) * 2


def test_explicit_values_win_and_are_not_reasoned() -> None:
    config = EngineConfig(
        role="decode", max_running_requests=32, max_batch_tokens=1024, prefix_cache=False,
        fp8_experts=False, fp8_linears=True, cuda_graph_max_batch=8,
    )  # fmt: skip
    d = derive(config, shape("v3-layers"), H200)
    assert d.config == config and d.reasons == {}


def test_offline_runs_keep_the_prefix_cache_off_and_a_small_pool_limits_the_batch() -> None:
    c = derive(EngineConfig(max_total_tokens=8192), shape("v2-lite"), H200).config
    assert c.prefix_cache is False
    assert c.max_running_requests == 8192 // 512


def test_fp8_experts_need_the_fp8_kernels() -> None:
    no_triton = DeviceFacts("cuda", H200.total_bytes, fp8_kernels=False)
    d = derive(EngineConfig(), shape("v3-layers"), no_triton)
    assert d.config.fp8_experts is False
    assert d.reasons["fp8_experts"] == "no FP8 kernels on this device"
    assert d.config.fp8_linears is False and d.reasons["fp8_linears"] == "as --fp8-experts"
    assert derive(EngineConfig(), shape("v2-lite"), H200).config.fp8_experts is False


def test_fp8_experts_need_whole_fp8_blocks() -> None:
    """A toy FP8 checkpoint (tiny-v3: 32 x 64 experts) loads its experts dequantised by
    default on CUDA rather than failing in the loader; V3's own experts tile into 128 x 128."""
    tiny = derive(EngineConfig(), shape("tiny-v3"), H200)
    assert tiny.config.fp8_experts is False
    assert tiny.reasons["fp8_experts"].startswith("the routed experts are not whole FP8 blocks")
    assert derive(EngineConfig(), shape("v3-layers"), H200).config.fp8_experts is True


def test_weights_beyond_the_share_are_refused_before_loading(monkeypatch) -> None:
    import torch

    import dsmesh.engine.derived as derived

    monkeypatch.setattr(derived, "device_facts", lambda device, kernels: GPU_80)
    config = EngineConfig(role="decode", mem_fraction=0.425, fp8_experts=False)
    with pytest.raises(MemoryPlanError) as err:
        check_weights_fit(config, shape("v3-layers"), torch.device("cuda"))
    text = str(err.value)
    assert "--mem-fraction 0.425" in text and "--fp8-experts" in text and "GiB" in text
    check_weights_fit(
        EngineConfig(role="unified", fp8_experts=True), shape("v3-layers"), torch.device("cuda")
    )
