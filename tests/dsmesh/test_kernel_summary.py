"""dsmesh/engine/runner/kernel_summary.py: the start-up table of which implementation serves each
op, and why, built from the choices an engine made (facts given as plain values, no GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.tiny_model import tiny_config
from dsmesh.engine.options import EngineConfig
from dsmesh.engine.runner.kernel_summary import (
    KernelFacts,
    describe_kernels,
    format_table,
    kernel_table,
)
from dsmesh.kernels.backends import Decision

FLASHINFER = Decision("flashinfer", "flashinfer-python 0.6.18.post1")
DEEP_GEMM = Decision("deep_gemm", "sgl-deep-gemm 0.1.5, built for torch 2.11 + CUDA 13")
NO_DEEP_EP = (
    "sgl-deep-ep 0.1.2 is built for torch 2.13.0 + CUDA 13, this is torch 2.11.0+cu130 "
    "(CUDA 13.0): no sgl-deep-ep build fits ..."
)

# the H200 with every optional library that fits its torch 2.11: V3 in bf16 with FP8 experts
H200 = KernelFacts(
    device="cuda",
    dtype="bfloat16",
    kernels="auto",
    decode_requested="auto",
    moe_backend="auto",
    tbo=False,
    triton=True,
    decode_chosen="flashinfer",
    fused_moe=True,
    fused_moe_max_tokens=256,
    decode_backend="flashinfer",
    deepseek_latent=True,
    fp8_experts=True,
    dispatch="local",
    flashinfer=FLASHINFER,
    deep_gemm=DEEP_GEMM,
    deep_ep_usable=False,
    deep_ep_detail="deep_ep not installed",
    fp8_linears="deep_gemm",
    fp8_linear_lib=DEEP_GEMM,
)


def _rows(facts: KernelFacts) -> dict[str, tuple[str, str]]:
    return {r.op: (r.implementation, r.why) for r in kernel_table(facts)}


def test_h200_with_flashinfer_and_deep_gemm() -> None:
    assert _rows(H200) == {
        "MLA decode attention": ("flashinfer", "flashinfer-python 0.6.18.post1"),
        "MLA prefill attention": (
            "triton",
            "dsmesh's ragged kernel (no FlashInfer prefill adapter)",
        ),
        "routed experts, prefill-sized": (
            "deep_gemm (>= 192 rows/expert), else triton FP8",
            "sgl-deep-gemm 0.1.5, built for torch 2.11 + CUDA 13",
        ),
        "routed experts, decode-sized (<= 256 tokens)": (
            "triton FP8 grouped GEMM",
            "FP8 experts (the fused MoE kernel takes bf16/fp16)",
        ),
        "FP8 GEMM": (
            "triton + deep_gemm",
            "routed experts; DeepGEMM: sgl-deep-gemm 0.1.5, built for torch 2.11 + CUDA 13",
        ),
        "dense linears (attention, shared experts)": (
            "deep_gemm FP8 (triton for shapes it refuses)",
            "128x128 block scales; sgl-deep-gemm 0.1.5, built for torch 2.11 + CUDA 13",
        ),
        "MoE dispatch (EP)": ("none", "one rank; DeepEP: deep_ep not installed"),
        "norm / rope / routing glue": (
            "triton",
            "fused add + RMSNorm, rope + latent norm + cache write, top-k",
        ),
        "sampling": ("torch", "argmax for greedy rows; sort + inverse CDF otherwise"),
    }


def test_refused_libraries_show_why_triton_runs() -> None:
    refusal = (
        "flashinfer-python 0.7.4 is not the release dsmesh's adapter was tested with "
        "(0.6.18.post1): pip install flashinfer-python==0.6.18.post1 (or bash "
        "scripts/setup-gpu.sh)"
    )
    facts = dataclasses.replace(
        H200,
        decode_chosen="triton",
        decode_backend="triton",
        fp8_experts=False,
        flashinfer=Decision("triton", refusal),
        deep_gemm=Decision("triton", "deep_gemm not installed"),
    )
    rows = _rows(facts)
    assert rows["MLA decode attention"] == ("triton", refusal)
    no_deep_gemm = dataclasses.replace(
        facts, fp8_linears="triton", fp8_linear_lib=Decision("triton", "deep_gemm not installed")
    )
    assert _rows(no_deep_gemm)["dense linears (attention, shared experts)"] == (
        "triton FP8 block GEMM",
        "DeepGEMM: deep_gemm not installed",
    )
    refused = dataclasses.replace(facts, fp8_linears="triton", fp8_linear_lib=DEEP_GEMM)
    assert _rows(refused)["dense linears (attention, shared experts)"] == (
        "triton FP8 block GEMM",
        "DeepGEMM failed its start-up check (see the warning above)",
    )
    dense = _rows(dataclasses.replace(facts, fp8_linears="none"))
    assert dense["dense linears (attention, shared experts)"] == (
        "bfloat16 GEMM",
        "not FP8 in the checkpoint, or loaded without --fp8-linears",
    )
    assert rows["routed experts, prefill-sized"] == (
        "torch grouped GEMM",
        "rows sorted by expert, one grouped matmul",
    )
    assert rows["routed experts, decode-sized (<= 256 tokens)"] == (
        "triton fused MoE",
        "one launch, shared experts included",
    )
    assert rows["FP8 GEMM"] == (
        "none",
        "no FP8 weights kept (an FP8 checkpoint loads as bfloat16 without --fp8-experts)",
    )
    fp8 = _rows(dataclasses.replace(facts, fp8_experts=True))
    assert fp8["routed experts, prefill-sized"] == (
        "triton FP8 grouped GEMM",
        "DeepGEMM: deep_gemm not installed",
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"tbo": True, "decode_chosen": "triton", "decode_backend": "triton"},
         ("triton", "two-batch overlap (a FlashInfer plan covers one batch)")),
        ({"decode_requested": "kernel", "decode_chosen": "triton", "decode_backend": "triton"},
         ("triton", "--decode-attention kernel")),
        ({"decode_backend": "triton"},
         ("triton", "FlashInfer failed to build its kernel (see the warning above)")),
        ({"deepseek_latent": False, "decode_chosen": "triton", "decode_backend": "triton"},
         ("triton", "the cache's latent is not DeepSeek's 512 + 64 (FlashInfer's MLA shape)")),
        ({"dtype": "float32", "decode_chosen": "torch", "decode_backend": "torch"},
         ("torch", "float32: the exact reference")),
        ({"decode_requested": "torch", "decode_chosen": "torch", "decode_backend": "torch"},
         ("torch", "--decode-attention torch")),
    ],
)  # fmt: skip
def test_decode_attention_reasons(changes, expected) -> None:
    assert _rows(dataclasses.replace(H200, **changes))["MLA decode attention"] == expected


def test_expert_parallel_dispatch_rows() -> None:
    ep = dataclasses.replace(
        H200, fp8_experts=False, dispatch="all-to-all", deep_ep_detail=NO_DEEP_EP
    )
    rows = _rows(ep)
    assert rows["MoE dispatch (EP)"] == ("torch.distributed all-to-all", f"DeepEP: {NO_DEEP_EP}")
    assert rows["routed experts, decode-sized (<= 256 tokens)"][0] == (
        "triton fused MoE in graphs, else torch grouped GEMM"
    )
    deepep = _rows(
        dataclasses.replace(
            ep, dispatch="deepep-low_latency", deep_ep_usable=True, deep_ep_detail="x"
        )
    )
    assert deepep["MoE dispatch (EP)"] == ("deepep low_latency", "x")
    with pytest.raises(ValueError, match="dispatch must be one of"):
        kernel_table(dataclasses.replace(H200, dispatch="nccl"))


def test_format_table_aligns_columns() -> None:
    rows = kernel_table(H200)
    lines = format_table(H200, rows).splitlines()
    assert lines[0] == "kernels on cuda, bfloat16:"
    assert len(lines) == 1 + len(rows) == 10
    op_end = 2 + len("routed experts, decode-sized (<= 256 tokens)") + 2  # the longest op
    impl_end = op_end + len("deep_gemm (>= 192 rows/expert), else triton FP8") + 2
    for line, row in zip(lines[1:], rows, strict=True):
        assert line[:op_end].strip() == row.op
        assert line[op_end:impl_end].strip() == row.implementation
        assert line[impl_end:] == row.why


def test_describe_kernels_on_a_cpu_model() -> None:
    """What the engine logs for the tiny model on CPU: every op on the torch references."""
    model = DeepseekForCausalLM(tiny_config("v3"))
    kernels = KernelChoice.resolve(torch.device("cpu"), torch.float32)
    model.set_kernels(kernels)
    text = describe_kernels(model, EngineConfig(), kernels, "torch")
    lines = text.splitlines()
    assert lines[0] == "kernels on cpu, float32:"
    decode = next(line for line in lines if "MLA decode attention" in line)
    assert " ".join(decode.split()) == (
        "MLA decode attention torch no CUDA (cpu): the torch reference"
    )
    dispatch = next(line for line in lines if "MoE dispatch (EP)" in line)
    assert dispatch.split()[3:5] == ["none", "one"]
