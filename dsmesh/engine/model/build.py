"""Build a model for a device and dtype, then fill it from a checkpoint or at random."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from dsmesh.engine.model.config import ModelConfig, load_config
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.fp8_linear import fp8_linear_names, swap_fp8_linears
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.moe import MoEGate, RoutedExperts
from dsmesh.engine.model.moe_dispatch import MoEDispatcher
from dsmesh.engine.model.weights import WeightError, checkpoint_dtypes, load_weights

M = TypeVar("M", bound=nn.Module)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    expert_location: ExpertLocation | None = None,
    dispatcher: MoEDispatcher | None = None,
    ep_rank: int = 0,
    dense_experts: bool = True,
    fp8_linears: set[str] | None = None,
) -> DeepseekForCausalLM:
    """Allocate an uninitialised model directly in ``dtype`` on ``device``.

    Built on the meta device first so a large model is never materialised twice. Router
    weights and the correction bias stay float32, as in the reference implementation.
    ``dense_experts=False``: the routed experts get no dense weights (they will be held in
    FP8 only, see :func:`load_model`). ``fp8_linears``: names of linear modules built as
    :class:`~dsmesh.engine.model.fp8_linear.Fp8Linear` (FP8 weight and block scales).
    """
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, expert_location, dispatcher, ep_rank)
        if not dense_experts:
            for module in model.modules():
                if isinstance(module, RoutedExperts):
                    module.w13 = nn.Parameter(module.w13[:0], requires_grad=False)
                    module.w2 = nn.Parameter(module.w2[:0], requires_grad=False)
    model = materialize(model, dtype, device, fp8_linears or set())
    model.model.rotary.reset_buffers()
    return model.eval()


def materialize(
    module: M, dtype: torch.dtype, device: torch.device | str, fp8_linears: set[str] = frozenset()
) -> M:
    """``module``, built on the meta device, as uninitialised storage in ``dtype`` on
    ``device``, its routers (``MoEGate``) in float32 as in the reference implementation and
    the linears named in ``fp8_linears`` in FP8 (swapped after the cast, which would
    otherwise turn their FP8 weights into ``dtype``). Buffers computed at construction
    (rotary tables) must be computed again after.

    A contiguous tensor (all of the model's) is allocated by ``torch.empty``, as
    ``Module.to_empty`` would but without its ``empty_like`` of a meta tensor, which runs
    torch's Python meta kernel, whose first call imports sympy (0.25 s of every engine's
    start-up, docs/RELIABILITY.md, Restart time); any other goes through ``empty_like``."""
    module = module.to(dtype)
    for sub in module.modules():
        if isinstance(sub, MoEGate):
            sub.float()
    swap_fp8_linears(module, fp8_linears)
    return module._apply(lambda t: _empty_on(t, device))


def _empty_on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Uninitialised storage on ``device`` in ``t``'s shape, dtype and layout."""
    if t.is_contiguous():
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return torch.empty_like(t, device=device)


def load_model(
    checkpoint_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    keep_fp8: bool = False,
    expert_location: ExpertLocation | None = None,
    dispatcher: MoEDispatcher | None = None,
    ep_rank: int = 0,
    fp8_only: bool = False,
    weights_read: str = "auto",
    fp8_linears: bool = False,
) -> DeepseekForCausalLM:
    """Read config.json and the safetensors of ``checkpoint_dir`` into a ready model, with
    the kernels "auto" picks for ``device`` and ``dtype`` (an engine may choose again).

    ``keep_fp8`` on CUDA gives the routed experts their FP8 form for the FP8 grouped GEMM.
    With ``fp8_only`` too they are held in FP8 alone: no dense copy is ever allocated, so a
    V3 checkpoint's experts take half the memory (one byte a weight). Experts that move
    later (EPLB under expert parallelism) need the dense copy: EP ranks keep it.
    ``weights_read`` (``WEIGHT_READS``): staged or through the memory map (auto: staged on
    CUDA). ``fp8_linears``: the attention projections and dense MLPs / shared experts that
    the checkpoint stores in FP8 with 128 x 128 block scales stay so (one byte a weight) and
    run block-scaled FP8 GEMMs (dsmesh/engine/model/fp8_linear.py); on any device (the CPU
    runs the torch reference)."""
    cfg = load_config(checkpoint_dir)
    cuda = torch.device(device).type == "cuda"
    lean = keep_fp8 and fp8_only and cuda
    names: set[str] = set()
    if fp8_linears and cfg.quant is not None and tuple(cfg.quant.weight_block_size) == (128, 128):
        with torch.device("meta"):
            shell = DeepseekForCausalLM(cfg)  # module names only
        names = fp8_linear_names(shell, checkpoint_dtypes(checkpoint_dir))
    model = build_model(
        cfg, dtype, device, expert_location, dispatcher, ep_rank, dense_experts=not lean,
        fp8_linears=names,
    )  # fmt: skip
    staged = weights_read == "staged" or (weights_read == "auto" and cuda)
    load_weights(model, checkpoint_dir, keep_fp8=keep_fp8, staged=staged)
    if keep_fp8 and cuda:
        from dsmesh.kernels.moe_gemm import attach_fp8_experts  # FP8 grouped GEMM for the experts

        attached = attach_fp8_experts(model)
        if lean:
            if attached != len(cfg.moe_layer_ids):
                raise WeightError(
                    f"--fp8-experts: {len(cfg.moe_layer_ids) - attached} MoE layer(s) have "
                    "experts that are not FP8 in 128 x 128 blocks; load with --no-fp8-experts"
                )
            model.fp8_weights.clear()  # the host copies: the device holds the experts now
    model.set_kernels(KernelChoice.resolve(torch.device(device), dtype))
    return model


@torch.no_grad()
def init_random(model: DeepseekForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights (CPU generator, so identical on every machine).

    Norm weights get 1 + noise, linear weights N(0, std), the correction bias N(0, std) so
    that V3's biased selection really matters.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        if name.endswith("rotary.inv_freq"):
            continue
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * std
        tensor.copy_(value.to(tensor.dtype))
