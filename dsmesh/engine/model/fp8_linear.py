"""The dense linear layers a checkpoint stores in block-scaled FP8, kept in FP8.

DeepSeek-V3/R1 checkpoints store every linear weight but the embeddings, the LM head and the
routers as float8_e4m3fn with 128 x 128 ``weight_scale_inv`` blocks. With ``fp8_linears``
(dsmesh/engine/options.py) the attention projections and the dense MLPs / shared experts stay
so: :class:`Fp8Linear` holds ``weight`` and ``weight_scale_inv`` under the checkpoint's own
names (the loader copies them as stored) and runs a block-scaled FP8 GEMM
(:mod:`dsmesh.kernels.fp8_linear`): one byte a weight read instead of two, and the FP8 tensor
cores. ``kv_b_proj`` is the exception: the weight-absorbed decode reads it as the dense
``W_UK`` / ``W_UV`` matrices (dsmesh/engine/model/mla.py), so it is dequantised at load.

:func:`fp8_linear_names` says which modules of a model the checkpoint holds in FP8;
:func:`swap_fp8_linears` replaces them (on the meta device, before the model is allocated).
"""

from __future__ import annotations

import torch
from torch import nn

from dsmesh.kernels.fp8 import BLOCK, FP8_DTYPE, block_scale_shape
from dsmesh.kernels.fp8_linear import fp8_linear

# Linear modules never held in FP8: the LM head stays as stored, and kv_b_proj is read dense
# by the weight-absorbed decode.
_DENSE_ONLY = ("lm_head", "kv_b_proj")
_FP8 = "F8_E4M3"


class Fp8Linear(nn.Module):
    """A bias-free linear layer with an FP8 weight.

    weight: [out_features, in_features] float8_e4m3fn;
    weight_scale_inv: [ceil(out / 128), ceil(in / 128)] float32 (the real weight is
        ``weight * weight_scale_inv`` block-wise);
    backend: "torch" (the reference: dequantise and multiply, exact on CPU), "triton" or
        "deep_gemm" (dsmesh.kernels.fp8_linear), set once by ``set_kernels``.
    Inputs [..., in_features] in the model's dtype; outputs the same dtype.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        rows, cols = block_scale_shape((out_features, in_features), (BLOCK, BLOCK))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(rows, cols, dtype=torch.float32), requires_grad=False
        )
        self.backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128"


def fp8_candidates(model: nn.Module) -> list[str]:
    """The modules of ``model`` that may be held in FP8: bias-free ``nn.Linear`` layers but
    kv_b_proj and the LM head (the attention projections, dense MLPs and shared experts)."""
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.bias is None
        and name.split(".")[-1] not in _DENSE_ONLY
    ]


def fp8_linear_names(model: nn.Module, checkpoint_dtypes: dict[str, str]) -> set[str]:
    """The :func:`fp8_candidates` of ``model`` whose checkpoint weight is FP8 with a
    ``weight_scale_inv`` beside it. ``checkpoint_dtypes``: tensor name -> safetensors dtype
    ("F8_E4M3", "BF16", ...)."""
    return {
        name
        for name in fp8_candidates(model)
        if checkpoint_dtypes.get(f"{name}.weight") == _FP8
        and f"{name}.weight_scale_inv" in checkpoint_dtypes
    }


@torch.no_grad()
def quantize_linears(model: nn.Module, names: list[str]) -> None:
    """Replace each ``nn.Linear`` named in ``names`` by an :class:`Fp8Linear` holding its
    weight quantised in 128 x 128 blocks, as a DeepSeek-V3 checkpoint stores it (random-weight
    benchmarks; call before ``set_kernels`` fuses projections)."""
    from dsmesh.kernels.fp8 import quantize_fp8_block

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        q, scale_inv = quantize_fp8_block(old.weight, (BLOCK, BLOCK))
        with torch.device("meta"):
            new = Fp8Linear(old.in_features, old.out_features)
        new.weight = nn.Parameter(q, requires_grad=False)
        new.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        setattr(parent, child, new)


def swap_fp8_linears(model: nn.Module, names: set[str]) -> None:
    """Replace each ``nn.Linear`` named in ``names`` by an :class:`Fp8Linear` of its shape,
    on the module's device (call it on the meta device, before allocation)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if type(old) is not nn.Linear:
            raise ValueError(f"{name} is {type(old).__name__}, not nn.Linear")
        with torch.device(old.weight.device):
            setattr(parent, child, Fp8Linear(old.in_features, old.out_features))


@torch.no_grad()
def fuse_fp8_linears(
    first: nn.Module, second: nn.Module
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight, weight_scale_inv) holding ``first``'s rows, then ``second``'s, when both are
    :class:`Fp8Linear` with one K and ``first``'s rows fill whole 128-row blocks (so the
    second's scale blocks stay aligned); both modules keep views of them, so no memory is
    added. None otherwise."""
    if not (isinstance(first, Fp8Linear) and isinstance(second, Fp8Linear)):
        return None
    if first.in_features != second.in_features or first.out_features % BLOCK:
        return None
    weight = torch.cat([first.weight, second.weight])
    scale = torch.cat([first.weight_scale_inv, second.weight_scale_inv])
    split, split_blocks = first.out_features, first.weight_scale_inv.shape[0]
    first.weight.data, second.weight.data = weight[:split], weight[split:]
    first.weight_scale_inv.data = scale[:split_blocks]
    second.weight_scale_inv.data = scale[split_blocks:]
    return weight, scale
