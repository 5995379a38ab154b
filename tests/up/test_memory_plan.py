"""``dsmesh up``'s memory plan (dsmesh/cli/memory_plan.py) with fake device sizes, and its
refusal through the command itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsmesh.bench.checkpoint import shape_config
from dsmesh.cli.memory_plan import MemoryPlanError, plan_cpu, plan_gpus
from dsmesh.cli.placement import EngineInstance, place
from dsmesh.engine.footprint import weight_bytes
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.options import EngineConfig
from dsmesh.runtime.gpus import parse_nvidia_smi

MIB = 1 << 20
GIB = 1 << 30
H200 = 143771 * MIB
PD = [EngineInstance("prefill", 0), EngineInstance("decode", 0)]
UNIFIED = [EngineInstance("unified", 0)]


def shape(name: str) -> ModelConfig:
    return ModelConfig.from_dict(shape_config(name))


def test_v2_lite_pd_on_one_h200_fits_and_each_process_gets_its_share() -> None:
    mc = shape("v2-lite")
    plan = plan_gpus(PD, place(["0"], PD), EngineConfig(), mc, {"0": H200}, 0.85)
    prefill, decode = plan.processes
    assert prefill.share == decode.share == 0.425
    assert prefill.weights == weight_bytes(mc, 2).total
    # the pool is what the share leaves after the weights, in whole pages
    assert prefill.kv_pool == pytest.approx(0.425 * H200 - prefill.weights, abs=16 * 31104)
    assert prefill.graphs == 0 and decode.graphs > 0  # prefill captures no decode graphs
    assert sum(p.total for p in plan.processes) <= H200
    assert "GPU 0:" in "\n".join(plan.lines())


def test_v3_layers_pd_on_one_h200_fits_with_fp8_experts_and_is_refused_without() -> None:
    mc = shape("v3-layers")
    plan = plan_gpus(PD, place(["0"], PD), EngineConfig(), mc, {"0": H200}, 0.85)
    assert all(p.config.fp8_experts for p in plan.processes)
    with pytest.raises(MemoryPlanError) as err:
        plan_gpus(PD, place(["0"], PD), EngineConfig(fp8_experts=False), mc, {"0": H200}, 0.85)
    text = str(err.value)
    assert "exceed its share of GPU 0" in text
    for fix in ("--unified 1", "--prefill-gpus 0 --decode-gpus 1", "--fp8-experts",
                "--mem-fraction", "--max-total-tokens"):  # fmt: skip
        assert fix in text


def test_one_unified_instance_holds_the_weights_once() -> None:
    mc = shape("v3-layers")
    plan = plan_gpus(
        UNIFIED, place(["0"], UNIFIED), EngineConfig(fp8_experts=False), mc, {"0": H200}, 0.85
    )
    assert plan.processes[0].weights == weight_bytes(mc, 2).total


def test_an_ep_rank_holds_its_share_of_the_experts() -> None:
    mc = shape("v3-layers")
    instances = [EngineInstance("prefill", 0, 2), EngineInstance("decode", 0, 2)]
    gpus = {g: H200 for g in "0123"}
    plan = plan_gpus(instances, place(list(gpus), instances), EngineConfig(), mc, gpus, 0.85)
    assert [p.name for p in plan.processes] == [
        "prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0", "decode-0/rank1",
    ]  # fmt: skip
    assert plan.processes[0].weights < weight_bytes(mc, 2, fp8_experts=True).total * 0.6


def test_a_pool_beyond_the_gpu_is_refused() -> None:
    mc = shape("v2-lite")
    engine = EngineConfig(max_total_tokens=10_000_000)
    with pytest.raises(MemoryPlanError, match=r"GPU 0: 2 process\(es\) need"):
        plan_gpus(PD, place(["0"], PD), engine, mc, {"0": H200}, 0.85)


def test_cpu_mesh_against_the_host_memory() -> None:
    mc = shape("tiny")
    plan = plan_cpu(PD, EngineConfig(), mc, 16 * GIB)
    assert [p.device for p in plan.processes] == ["host", "host"]
    with pytest.raises(MemoryPlanError, match="--max-total-tokens"):
        plan_cpu(PD, EngineConfig(max_total_tokens=10**11), mc, 16 * GIB)


def test_nvidia_smi_lines_map_by_index_and_uuid() -> None:
    text = "0, GPU-aaa, 143771\n1, GPU-bbb, 81559\n"
    assert parse_nvidia_smi(text) == {
        "0": 143771 * MIB, "GPU-aaa": 143771 * MIB, "1": 81559 * MIB, "GPU-bbb": 81559 * MIB,
    }  # fmt: skip


def test_up_refuses_an_impossible_pool_before_starting_anything(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsmesh", "up", "--log-dir", str(tmp_path),
         "--max-total-tokens", str(10**12)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "dsmesh up: error: the engine processes need" in proc.stderr
    assert "available" in proc.stderr and "--max-total-tokens" in proc.stderr
    assert not list(tmp_path.glob("*.log"))  # no service was started


def test_an_fp8_kv_cache_plans_its_own_bytes_per_token() -> None:
    """--kv-cache-dtype fp8_e4m3: 576 one-byte values and two float32 scales a token and
    layer (584 bytes, 1152 in bf16), so the same share holds ~1.97x the tokens."""
    mc = shape("v2-lite")
    layers = mc.num_hidden_layers
    plans = {
        name: plan_gpus(
            UNIFIED, place(["0"], UNIFIED), EngineConfig(kv_cache_dtype=name), mc, {"0": H200}, 0.85
        ).processes[0]
        for name in ("auto", "fp8_e4m3")
    }
    assert plans["auto"].kv_per_token == layers * 1152
    assert plans["fp8_e4m3"].kv_per_token == layers * 584
    ratio = plans["fp8_e4m3"].kv_tokens / plans["auto"].kv_tokens
    assert ratio == pytest.approx(1152 / 584, rel=1e-3)
    with pytest.raises(MemoryPlanError, match="--kv-cache-dtype fp8_e4m3"):
        plan_gpus(PD, place(["0"], PD), EngineConfig(fp8_experts=False), shape("v3-layers"),
                  {"0": H200}, 0.85)  # fmt: skip
