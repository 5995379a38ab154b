"""The start-up table of which implementation serves each op of the forward, and why.

:func:`kernel_table` is a pure function of :class:`KernelFacts`, the choices an engine made
once at start (dsmesh/engine/model/kernel_choice.py, the attention backends, the MoE dispatcher)
and what the optional libraries' checks said (dsmesh/kernels/backends.py,
dsmesh/kernels/libraries.py). :func:`describe_kernels` gathers those facts from a model whose
kernels are set and formats the table the engine logs:

    kernels on cuda, bfloat16:
      MLA decode attention        flashinfer          flashinfer-python 0.6.18.post1
      MLA prefill attention       triton              dsmesh's ragged kernel (no FlashInfer adapter)
      ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsmesh.kernels.backends import Decision

if TYPE_CHECKING:
    from dsmesh.engine.model.deepseek import DeepseekForCausalLM
    from dsmesh.engine.model.kernel_choice import KernelChoice
    from dsmesh.engine.options import EngineConfig

DEEPSEEK_LATENT = (512, 64)  # kv_lora_rank, rope dim: the shape FlashInfer's MLA kernels take
DISPATCHES = ("local", "all-to-all", "deepep-normal", "deepep-low_latency")


@dataclass(frozen=True)
class KernelFacts:
    """What an engine chose, in plain values.

    device / dtype: where and in what the model runs ("cuda", "bfloat16");
    kernels, decode_requested, moe_backend, tbo: the engine's settings as given
        (``EngineConfig.kernels``, ``decode_attention``, ``moe_backend``, ``tbo``);
    triton, decode_chosen, fused_moe, fused_moe_max_tokens: the resolved KernelChoice
        (``decode_chosen`` before the backend was built, which may fall back to Triton);
    decode_backend: the decode attention backend that runs ("torch", "triton", "flashinfer");
    deepseek_latent: the KV cache holds DeepSeek's 512 + 64 latent;
    fp8_experts: routed experts kept in FP8 on some MoE layer;
    dispatch: one of :data:`DISPATCHES` (the MoE layers' dispatcher);
    flashinfer, deep_gemm: ``dsmesh.kernels.backends.decide`` for "mla_decode" and
        "moe_fp8_gemm"; deep_ep_usable / deep_ep_detail: DeepEP's library check;
    fp8_linears: the GEMM of the dense linears held in FP8 ("torch", "triton", "deep_gemm"),
        "none" when none is (dsmesh/engine/model/fp8_linear.py); fp8_linear_lib:
        ``decide("fp8_linear")``.
    """

    device: str
    dtype: str
    kernels: str
    decode_requested: str
    moe_backend: str
    tbo: bool
    triton: bool
    decode_chosen: str
    fused_moe: bool
    fused_moe_max_tokens: int
    decode_backend: str
    deepseek_latent: bool
    fp8_experts: bool
    dispatch: str
    flashinfer: Decision
    deep_gemm: Decision
    deep_ep_usable: bool
    deep_ep_detail: str
    fp8_linears: str = "none"
    fp8_linear_lib: Decision = Decision("triton", "deep_gemm not installed")


@dataclass(frozen=True)
class KernelRow:
    op: str
    implementation: str
    why: str


def _torch_reason(f: KernelFacts) -> str:
    """Why the torch references run instead of Triton kernels."""
    if f.kernels == "torch":
        return "--kernels torch"
    if f.device != "cuda":
        return f"no CUDA ({f.device}): the torch reference"
    return "Triton is not importable"


def _decode_attention(f: KernelFacts) -> KernelRow:
    op = "MLA decode attention"
    if f.decode_backend == "flashinfer":
        return KernelRow(op, "flashinfer", f.flashinfer.why)
    if f.decode_backend == "torch":
        if f.decode_requested == "torch":
            return KernelRow(op, "torch", "--decode-attention torch")
        if f.triton and f.dtype == "float32":
            return KernelRow(op, "torch", "float32: the exact reference")
        return KernelRow(op, "torch", _torch_reason(f))
    if f.decode_requested == "kernel":
        why = "--decode-attention kernel"
    elif f.decode_chosen == "flashinfer":
        why = "FlashInfer failed to build its kernel (see the warning above)"
    elif f.flashinfer.backend != "flashinfer":
        why = f.flashinfer.why
    elif not f.deepseek_latent:
        why = "the cache's latent is not DeepSeek's 512 + 64 (FlashInfer's MLA shape)"
    elif f.tbo:
        why = "two-batch overlap (a FlashInfer plan covers one batch)"
    else:
        why = "dsmesh's split-K kernel"
    return KernelRow(op, "triton", why)


def _prefill_experts(f: KernelFacts) -> KernelRow:
    op = "routed experts, prefill-sized"
    if f.fp8_experts and f.triton:
        if f.deep_gemm.backend == "deep_gemm":
            impl = "deep_gemm (>= 192 rows/expert), else triton FP8"
            return KernelRow(op, impl, f.deep_gemm.why)
        return KernelRow(op, "triton FP8 grouped GEMM", f"DeepGEMM: {f.deep_gemm.why}")
    if f.fp8_experts:
        return KernelRow(
            op, "torch grouped GEMM", f"dense copy of the FP8 experts: {_torch_reason(f)}"
        )
    return KernelRow(op, "torch grouped GEMM", "rows sorted by expert, one grouped matmul")


def _decode_experts(f: KernelFacts) -> KernelRow:
    op = f"routed experts, decode-sized (<= {f.fused_moe_max_tokens} tokens)"
    if f.fp8_experts and f.triton:
        return KernelRow(
            op, "triton FP8 grouped GEMM", "FP8 experts (the fused MoE kernel takes bf16/fp16)"
        )
    if f.fused_moe and f.dispatch == "local":
        return KernelRow(op, "triton fused MoE", "one launch, shared experts included")
    if f.fused_moe:
        return KernelRow(
            op,
            "triton fused MoE in graphs, else torch grouped GEMM",
            "expert parallelism: received rows in place in captured steps",
        )
    if f.moe_backend == "grouped":
        return KernelRow(op, "torch grouped GEMM", "--moe-backend grouped")
    if not f.triton:
        return KernelRow(op, "torch grouped GEMM", _torch_reason(f))
    return KernelRow(op, "torch grouped GEMM", f"{f.dtype}: the fused kernel takes bf16/fp16")


def _fp8_gemm(f: KernelFacts) -> KernelRow:
    op = "FP8 GEMM"
    if not f.fp8_experts:
        why = f"no FP8 weights kept (an FP8 checkpoint loads as {f.dtype} without --fp8-experts)"
        return KernelRow(op, "none", why)
    if not f.triton:
        return KernelRow(op, "none", f"FP8 experts run their dense copy: {_torch_reason(f)}")
    if f.deep_gemm.backend == "deep_gemm":
        return KernelRow(op, "triton + deep_gemm", f"routed experts; DeepGEMM: {f.deep_gemm.why}")
    return KernelRow(op, "triton", "routed experts, 128x128 block scales")


def _dense_linears(f: KernelFacts) -> KernelRow:
    op = "dense linears (attention, shared experts)"
    if f.fp8_linears == "none":
        why = "not FP8 in the checkpoint, or loaded without --fp8-linears"
        return KernelRow(op, f"{f.dtype} GEMM", why)
    if f.fp8_linears == "deep_gemm":
        impl = "deep_gemm FP8 (triton for shapes it refuses)"
        return KernelRow(op, impl, f"128x128 block scales; {f.fp8_linear_lib.why}")
    if f.fp8_linears == "triton" and f.fp8_linear_lib.backend == "deep_gemm":
        why = "DeepGEMM failed its start-up check (see the warning above)"
        return KernelRow(op, "triton FP8 block GEMM", why)
    if f.fp8_linears == "triton":
        return KernelRow(op, "triton FP8 block GEMM", f"DeepGEMM: {f.fp8_linear_lib.why}")
    return KernelRow(op, "torch FP8 reference", _torch_reason(f))


def _dispatch(f: KernelFacts) -> KernelRow:
    op = "MoE dispatch (EP)"
    deep_ep = f"DeepEP: {f.deep_ep_detail}"
    if f.dispatch == "local":
        return KernelRow(op, "none", f"one rank; {deep_ep}")
    if f.dispatch.startswith("deepep-"):
        return KernelRow(op, f"deepep {f.dispatch.removeprefix('deepep-')}", f.deep_ep_detail)
    why = deep_ep if not f.deep_ep_usable else "see the 'MoE dispatch' line above"
    return KernelRow(op, "torch.distributed all-to-all", why)


def kernel_table(f: KernelFacts) -> list[KernelRow]:
    """One row per op: MLA decode and prefill attention, routed experts at prefill and
    decode sizes, FP8 GEMM, the dense linears, MoE dispatch, the norm/rope/routing glue and
    sampling."""
    if f.dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {f.dispatch!r}")
    triton_or_torch = ("triton", None) if f.triton else ("torch", _torch_reason(f))
    return [
        _decode_attention(f),
        KernelRow(
            "MLA prefill attention",
            triton_or_torch[0],
            triton_or_torch[1] or "dsmesh's ragged kernel (no FlashInfer prefill adapter)",
        ),
        _prefill_experts(f),
        _decode_experts(f),
        _fp8_gemm(f),
        _dense_linears(f),
        _dispatch(f),
        KernelRow(
            "norm / rope / routing glue",
            triton_or_torch[0],
            triton_or_torch[1] or "fused add + RMSNorm, rope + latent norm + cache write, top-k",
        ),
        KernelRow("sampling", "torch", "argmax for greedy rows; sort + inverse CDF otherwise"),
    ]


def format_table(f: KernelFacts, rows: list[KernelRow]) -> str:
    """The rows as aligned text under a "kernels on <device>, <dtype>:" line."""
    op_width = max(len(r.op) for r in rows)
    impl_width = max(len(r.implementation) for r in rows)
    lines = [f"kernels on {f.device}, {f.dtype}:"]
    lines += [
        f"  {r.op:<{op_width}}  {r.implementation:<{impl_width}}  {r.why}".rstrip() for r in rows
    ]
    return "\n".join(lines)


def _dispatch_name(dispatcher: object) -> str:
    name = type(dispatcher).__name__
    if name == "DeepEPLowLatencyDispatcher":
        return "deepep-low_latency"
    if name == "DeepEPNormalDispatcher":
        return "deepep-normal"
    if name == "AllToAllDispatcher":
        return "all-to-all"
    return "local"


def describe_kernels(
    model: DeepseekForCausalLM,
    config: EngineConfig,
    kernels: KernelChoice,
    decode_backend: str,
) -> str:
    """The table for ``model`` after ``set_kernels``: ``config`` as given, ``kernels`` as
    resolved, ``decode_backend`` the name of the decode attention backend built."""
    from dsmesh.engine.model.fp8_linear import Fp8Linear
    from dsmesh.kernels.backends import decide
    from dsmesh.kernels.libraries import status

    attn = model.model.layers[0].self_attn
    moe = model.moe_layers()
    param = next(model.parameters())
    deep_ep = status("deep_ep")
    facts = KernelFacts(
        device=param.device.type,
        dtype=str(param.dtype).removeprefix("torch."),
        kernels=config.kernels,
        decode_requested=config.decode_attention,
        moe_backend=config.moe_backend,
        tbo=bool(config.tbo),
        triton=kernels.triton,
        decode_chosen=kernels.decode_attention,
        fused_moe=kernels.fused_moe,
        fused_moe_max_tokens=kernels.fused_moe_max_tokens,
        decode_backend=decode_backend,
        deepseek_latent=(attn.kv_lora_rank, attn.rope_dim) == DEEPSEEK_LATENT,
        fp8_experts=any(m.experts.fp8 is not None for m in moe),
        dispatch=_dispatch_name(moe[0].dispatcher) if moe else "local",
        flashinfer=decide("mla_decode"),
        deep_gemm=decide("moe_fp8_gemm"),
        deep_ep_usable=deep_ep.usable,
        deep_ep_detail=deep_ep.detail,
        fp8_linears=next((m.backend for m in model.modules() if isinstance(m, Fp8Linear)), "none"),
        fp8_linear_lib=decide("fp8_linear"),
    )
    return format_table(facts, kernel_table(facts))
