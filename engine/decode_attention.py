"""Which MLA decode attention kernel a model runs: dsmesh's Triton kernel or FlashInfer's.

The choice is a policy over the engine's setting ("auto", "kernel", "flashinfer", "torch"),
the model's latent shape, the dtype and what is installed; both decode paths use it:

- the CUDA-graph runner (engine/cuda_graph.py), one capturable FlashInfer wrapper per batch
  bucket, re-planned before each replay;
- the eager forward (expert parallelism, two-batch overlap off, batches above the largest
  graph bucket): the engine plans once per forward and hands the planned kernel to every
  layer through ``ForwardBatch.decode_attention``.

"auto" takes FlashInfer where kernels.backends has a tested adapter, it is installed, the
dtype is bf16/fp16 and the cache holds DeepSeek's latent (512 + 64, the shape its kernels are
built and tested for). It builds the kernel at once (FlashInfer compiles on first use), and
falls back to Triton with a warning when that fails; an explicit "flashinfer" raises instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kernels.backends import available, choose

if TYPE_CHECKING:
    from engine.model import DeepseekForCausalLM
    from kernels.mla_decode_flashinfer import FlashInferMLADecode

log = logging.getLogger(__name__)

# "kernel" is dsmesh's Triton kernel, "torch" its reference.
ATTENTION_BACKENDS = ("auto", "kernel", "flashinfer", "torch")
DEEPSEEK_LATENT = (512, 64)  # kv_lora_rank, qk_rope_head_dim


def wants_flashinfer(
    attention: str, model: DeepseekForCausalLM, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether ``attention`` asks for FlashInfer here (explicitly, or "auto" where it fits)."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if attention == "flashinfer":
        return True
    attn = model.model.layers[0].self_attn
    return (
        attention == "auto"
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and (attn.kv_lora_rank, attn.rope_dim) == DEEPSEEK_LATENT
        and choose("mla_decode") == "flashinfer"
    )


def make_flashinfer(
    attention: str,
    model: DeepseekForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    max_pages_per_request: int,
    graph: bool,
) -> FlashInferMLADecode | None:
    """A built FlashInfer decode kernel when ``attention`` wants one here, else None."""
    if not wants_flashinfer(attention, model, device, dtype):
        return None
    try:
        if device.type != "cuda":
            raise ValueError("attention='flashinfer' needs CUDA")
        if not available("flashinfer"):
            raise ValueError(
                "attention='flashinfer' but FlashInfer is not installed "
                "(pip install flashinfer-python)"
            )
        from kernels.mla_decode_flashinfer import FlashInferMLADecode

        attn = model.model.layers[0].self_attn
        flashinfer = FlashInferMLADecode(
            device,
            attn.num_heads,
            attn.kv_lora_rank,
            attn.rope_dim,
            page_size,
            dtype,
            attn.scale,
            max_pages_per_request,
            graph=graph,
        )
        flashinfer.warm_up()
    except Exception as exc:  # e.g. no CUDA compiler for its first-use build
        if attention == "flashinfer":
            raise
        log.warning("FlashInfer MLA decode unavailable (%s); using Triton", exc)
        return None
    return flashinfer
