"""Which kernels the model's modules run: chosen once when an engine starts, never per call.

The model's modules (RMSNorm, MLAttention, DeepseekMoE, the router) read one frozen
:class:`KernelChoice` that :meth:`dsmesh.engine.model.deepseek.DeepseekForCausalLM.set_kernels`
hands them. Nothing reads the environment or re-decides per forward; the torch references stay the
exact path on CPU and in float32, and ``kernels="torch"`` forces them anywhere (A/B runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsmesh.kernels._triton import triton_importable

log = logging.getLogger(__name__)

KERNEL_SETS = ("auto", "torch")
MOE_BACKENDS = ("auto", "fused", "grouped")
# Decode batches up to this many tokens take the fused MoE kernel (the graph buckets' range);
# larger ones (prefill chunks) take the grouped GEMM, which is faster with many rows per expert.
FUSED_MOE_MAX_TOKENS = 256


@dataclass(frozen=True)
class KernelChoice:
    """triton: dsmesh's Triton kernels for the glue (RMSNorm and add + RMSNorm, rope + latent
        norm + cache write, routing, FP8 experts) and the ragged prefill attention;
    decode_attention: "torch" (reference), "triton" or "flashinfer" (see
        :mod:`dsmesh.engine.model.mla_decode_backend`);
    fused_moe: decode-sized batches (``<= fused_moe_max_tokens``) run the one-launch MoE
        kernel (dsmesh.kernels.moe_fused) with the shared experts riding along, on a single rank;
    fp8_linear: the GEMM of the dense linears held in FP8 (dsmesh/engine/model/fp8_linear.py):
        "torch" (dequantise and multiply), "triton" or "deep_gemm" (DeepGEMM's ``fp8_gemm_nt``
        where installed and usable; Triton for the shapes it does not take).
    """

    triton: bool = False
    decode_attention: str = "torch"
    fused_moe: bool = False
    fused_moe_max_tokens: int = FUSED_MOE_MAX_TOKENS
    fp8_linear: str = "torch"

    @classmethod
    def reference(cls) -> KernelChoice:
        """Plain torch everywhere: the exact path tests compare against."""
        return cls()

    @classmethod
    def resolve(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        kernels: str = "auto",
        decode_attention: str = "auto",
        moe_backend: str = "auto",
        flashinfer_fits: bool = False,
    ) -> KernelChoice:
        """The choice for a model in ``dtype`` on ``device``.

        ``kernels``: "auto" (Triton kernels on CUDA when Triton imports) or "torch".
        ``decode_attention``: "auto" (FlashInfer when ``flashinfer_fits``, else Triton; the
        torch reference in float32, the exact precision), "kernel" (Triton), "flashinfer" or
        "torch". ``moe_backend``: "auto" / "fused" (the fused decode MoE in bf16/fp16) or
        "grouped" (grouped GEMMs only). Explicit kernels that cannot run here raise.
        """
        if kernels not in KERNEL_SETS:
            raise ValueError(f"kernels must be one of {KERNEL_SETS}, got {kernels!r}")
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {moe_backend!r}")
        gpu = device.type == "cuda" and triton_importable()
        triton = gpu and kernels == "auto"
        low_precision = dtype in (torch.bfloat16, torch.float16)
        return cls(
            triton=triton,
            decode_attention=_decode_attention(decode_attention, triton, dtype, flashinfer_fits),
            fused_moe=_fused_moe(moe_backend, triton and low_precision),
            fp8_linear=_fp8_linear(triton and low_precision, dtype),
        )


def _decode_attention(requested: str, triton: bool, dtype: torch.dtype, flashinfer: bool) -> str:
    if requested == "torch":
        return "torch"
    if requested == "flashinfer":
        return "flashinfer"  # the backend's constructor says why when it cannot run
    if requested == "kernel":
        if not triton:
            raise ValueError("decode_attention='kernel' needs CUDA with Triton (and kernels=auto)")
        return "triton"
    if requested != "auto":
        raise ValueError(f"unknown decode attention {requested!r}")
    if not triton or dtype == torch.float32:
        return "torch"  # float32 is the reference precision: keep exact torch arithmetic
    return "flashinfer" if flashinfer else "triton"


def _fused_moe(requested: str, usable: bool) -> bool:
    if requested == "fused" and not usable:
        raise ValueError("moe_backend='fused' needs bf16 or fp16 weights on CUDA with Triton")
    return requested != "grouped" and usable


def _fp8_linear(usable: bool, dtype: torch.dtype) -> str:
    """DeepGEMM when its adapter is usable here (installed, a build that fits this torch,
    reading tensors right: dsmesh.kernels.backends; its dense GEMM checked once on a small
    problem) and the model is bf16, else Triton; the torch reference where Triton kernels
    are not chosen (CPU, float32, kernels=torch)."""
    if not usable:
        return "torch"
    from dsmesh.kernels.backends import choose

    if dtype == torch.bfloat16 and choose("fp8_linear") == "deep_gemm":
        from dsmesh.kernels.fp8_linear import deep_gemm_linear_problem
        from dsmesh.kernels.moe_gemm_deepgemm import load_deep_gemm

        if load_deep_gemm() is not None:
            problem = deep_gemm_linear_problem()
            if not problem:
                return "deep_gemm"
            log.warning("FP8 linears: DeepGEMM refused (%s); using dsmesh's Triton GEMM", problem)
    return "triton"
