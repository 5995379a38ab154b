"""DeepSeekMoE layer: router, routed experts behind a dispatcher, and shared experts.

The layer never assumes where experts live. It routes to *logical* experts, asks the
:class:`ExpertLocation` for a *physical* replica of each, and hands the pairs to a
:class:`MoEDispatcher`; this rank's :class:`RoutedExperts` hold only its own physical experts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.expert_location import DeviceExpertMap, ExpertLocation
from dsmesh.engine.model.fp8_linear import Fp8Linear, fuse_fp8_linears
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.linear_fusion import fuse_linears
from dsmesh.engine.model.moe_dispatch import DispatchOutput, LocalDispatcher, MoEDispatcher, Pending
from dsmesh.engine.model.moe_routing import routing_config, select_experts
from dsmesh.kernels.fp8 import Fp8ExpertWeights
from dsmesh.kernels.fp8_linear import fp8_linear
from dsmesh.kernels.moe_gemm import expert_ffn, expert_ffn_fp8, grouped_mm_supported

__all__ = ["DeepseekMoE", "DenseMLP", "MoEGate", "RoutedExperts", "grouped_mm_supported"]


class DenseMLP(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). Names match the checkpoint."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # One weight for gate and up, made by fuse_gate_up when the kernels are set; the two
        # modules keep views of it. ``triton``: SwiGLU in one pass (dsmesh.kernels.activation).
        self.gate_up_weight: torch.Tensor | None = None
        # The same when gate and up are held in FP8 (dsmesh/engine/model/fp8_linear.py):
        # (weight, weight_scale_inv), run by gate_proj's backend.
        self.gate_up_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.triton = False

    def fuse_gate_up(self) -> bool:
        """Move gate and up into one weight, so one GEMM computes both (three launches a
        forward instead of five; dsmesh/engine/model/linear_fusion.py): every reader, the fused MoE
        kernel's shared experts too, sees the same values. FP8 projections fuse their
        weights and scales (dsmesh/engine/model/fp8_linear.py). Returns whether fused."""
        if isinstance(self.gate_proj, Fp8Linear):
            self.gate_up_fp8 = fuse_fp8_linears(self.gate_proj, self.up_proj)
            return self.gate_up_fp8 is not None
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)
        return self.gate_up_weight is not None

    @property
    def fused(self) -> bool:
        """Whether :meth:`fuse_gate_up` has fused gate and up."""
        return self.gate_up_weight is not None or self.gate_up_fp8 is not None

    @property
    def fp8(self) -> bool:
        """Whether the projections are held in FP8 (the fused MoE kernel reads bf16/fp16)."""
        return isinstance(self.gate_proj, Fp8Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gate_up_weight
        if self.gate_up_fp8 is not None:
            fp8_weight, scale_inv = self.gate_up_fp8
            gate_up = fp8_linear(x, fp8_weight, scale_inv, self.gate_proj.backend)
        elif weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            gate_up = F.linear(x, weight)
        if self.triton and gate_up.dim() == 2 and gate_up.is_cuda:
            from dsmesh.kernels.activation import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoEGate(nn.Module):
    """Router weight [n_routed, hidden] and V3's correction bias [n_routed], kept in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.moe.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(n, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor | None
        if cfg.moe.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(n, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # The weight in the model's dtype where that loses nothing (checkpoints store it in
        # bf16), set by prepare(): one GEMM with float32 output then replaces casting the
        # input to float32 and a float32 GEMM (the same exact products, summed in float32).
        self.low_weight: torch.Tensor | None = None
        self._low_weight_t: torch.Tensor | None = None  # its transpose, a view made once

    @torch.no_grad()
    def prepare(self, dtype: torch.dtype) -> None:
        """Keep a ``dtype`` copy of the weight when it is exact and this torch has
        ``torch.mm(..., out_dtype=torch.float32)`` for it on the weight's device (CUDA)."""
        w = self.weight
        self.low_weight = self._low_weight_t = None
        if w.device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return
        low = w.to(dtype)
        if torch.equal(low.float(), w) and _mm_out_dtype_works(w.device, dtype):
            self.low_weight, self._low_weight_t = low, low.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> router logits [T, n_routed] float32."""
        low_t = self._low_weight_t
        if low_t is not None and x.dtype == low_t.dtype:
            return torch.mm(x, low_t, out_dtype=torch.float32)
        return F.linear(x.to(torch.float32), self.weight.to(torch.float32))


@functools.cache
def _grouped_mm_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """torch._grouped_mm keeps its group offsets on the device only on its fast path
    (bfloat16 on sm90+); elsewhere it copies them to the host, which breaks capture."""
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def _mm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has ``torch.mm(a, b, out_dtype=torch.float32)`` for ``dtype`` here."""
    a = torch.zeros(1, 16, dtype=dtype, device=device)
    try:
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class RoutedExperts(nn.Module):
    """This rank's physical experts, stacked for grouped GEMMs.

    w13: [num_local, 2 * moe_intermediate, hidden] (gate rows, then up rows).
    w2:  [num_local, hidden, moe_intermediate].
    """

    def __init__(self, num_local: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_local = num_local
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.zeros(num_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.zeros(num_local, hidden_size, intermediate_size))
        # The checkpoint's FP8 form of the same experts
        # (dsmesh.kernels.moe_gemm.attach_fp8_experts);
        # on CUDA it replaces the dense weights in forward.
        self.fp8: Fp8ExpertWeights | None = None
        self.triton = False  # FP8 experts through the Triton grouped GEMM; set by set_kernels

    @property
    def has_dense(self) -> bool:
        """False when the experts are held in FP8 only (``fp8``; dsmesh/engine/model/build.py)."""
        return self.w13.shape[0] > 0 or self.num_local == 0

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] grouped by local expert; tokens_per_expert [num_local] -> [N, H]."""
        if self.fp8 is not None and self.triton:
            if not hidden.shape[0]:
                return torch.empty_like(hidden)
            return expert_ffn_fp8(hidden, tokens_per_expert, self.fp8)
        if not self.has_dense:
            raise RuntimeError(
                "the routed experts are held in FP8 only, which needs dsmesh's Triton FP8 "
                "kernels on CUDA (--kernels auto); load with --no-fp8-experts for other paths"
            )
        capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and not _grouped_mm_capturable(hidden.dtype, hidden.device):
            return self.forward_masked(hidden, tokens_per_expert)
        if hidden.shape[0] and grouped_mm_supported(hidden.dtype, hidden.device.type):
            return expert_ffn(hidden, tokens_per_expert, self.w13, self.w2)
        return self.forward_reference(hidden, tokens_per_expert)

    def forward_rows(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, fused: bool
    ) -> torch.Tensor:
        """hidden [N, H] in any order (rows may be strided), row i for local expert
        ``expert_ids[i]`` ([N], may be strided; -1: padding, its output row is left
        unspecified) -> [N, H]. ``fused``: one fused MoE launch (dsmesh.kernels.moe_fused; each row
        a single pair of weight 1, read in place), else grouped by expert."""
        if fused and self.fp8 is None:
            from dsmesh.kernels.moe_fused import fused_moe

            return fused_moe(hidden, self.w13, self.w2, expert_ids[:, None], None)
        key = torch.where(expert_ids < 0, self.num_local, expert_ids)
        perm = torch.argsort(key, stable=True)  # padding last, past every expert's rows
        counts = torch.zeros(self.num_local + 1, dtype=torch.int64, device=hidden.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        grouped = self(hidden.index_select(0, perm), counts[: self.num_local])
        return torch.empty_like(grouped).index_copy_(0, perm, grouped)

    def forward_masked(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, kept where the row is that expert's: no host sync, so
        it can be captured where the grouped GEMM cannot (dtypes other than bf16 on sm90+),
        at E times the FLOPs."""
        ends = tokens_per_expert.cumsum(0)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        expert_of_row = torch.searchsorted(ends, rows, right=True)
        out = torch.zeros_like(hidden)
        for e in range(self.num_local):
            gate, up = F.linear(hidden, self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out += y * (expert_of_row == e)[:, None].to(y.dtype)
        return out

    def forward_reference(
        self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """Plain per-expert loop; the grouped GEMM above must equal it."""
        out = torch.empty_like(hidden)
        start = 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            if n == 0:
                continue
            x = hidden[start : start + n]
            gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, self.w2[e])
            start += n
        return out


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        moe_layer_idx: int,
        location: ExpertLocation,
        dispatcher: MoEDispatcher,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.routing = routing_config(cfg.moe)
        self.moe_layer_idx = moe_layer_idx
        self._location = location
        self.dispatcher = dispatcher
        self.ep_rank = ep_rank
        self.gate = MoEGate(cfg)
        self.experts = RoutedExperts(
            location.num_local_physical, cfg.hidden_size, cfg.moe.moe_intermediate_size
        )
        self.load_recorder = None  # dsmesh.engine.ep.load_recorder.ExpertLoadRecorder, when set
        self.shared_experts: DenseMLP | None = None
        if cfg.moe.n_shared_experts:
            self.shared_experts = DenseMLP(
                cfg.hidden_size, cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts
            )
        # Set by set_kernels, once: the kernel choice and the placement on the device.
        self.kernels = KernelChoice.reference()
        self.expert_map: DeviceExpertMap | None = None

    @property
    def location(self) -> ExpertLocation:
        return self._location

    @location.setter
    def location(self, location: ExpertLocation) -> None:
        """A new placement (EPLB swap); the device map is updated in place, so captured
        graphs route by it too."""
        self._location = location
        if self.expert_map is not None:
            self.expert_map.update(location)

    def set_kernels(self, kernels: KernelChoice, device: torch.device) -> None:
        self.kernels = kernels
        self.experts.triton = kernels.triton
        self.dispatcher.triton = kernels.triton  # shared by the layers: the same choice
        self.expert_map = DeviceExpertMap(self._location, self.moe_layer_idx, device)
        self.gate.prepare(self.experts.w13.dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, physical expert ids [T, k] int64)."""
        logits, bias, triton = self.gate(x), self.gate.e_score_correction_bias, self.kernels.triton
        emap = self.expert_map
        if emap is not None and emap.single:  # the map rides along in the routing kernel
            return select_experts(logits, self.routing, bias, emap.first, triton=triton)
        weights, logical = select_experts(logits, self.routing, bias, triton=triton)
        if emap is not None:
            num_local = self._location.num_local_physical
            return weights, emap.to_physical(logical, self.ep_rank, num_local)
        return weights, self._location.to_physical(self.moe_layer_idx, logical, self.ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self._fused(x):
            return self._forward_fused(x)
        return self.finish(x, self.compute(self.start(x)))

    def _fused(self, x: torch.Tensor) -> bool:
        """Decode-sized batches on one rank take the fused MoE kernel when it is chosen."""
        k = self.kernels
        return (
            k.fused_moe
            and 0 < x.shape[0] <= k.fused_moe_max_tokens
            and self.experts.fp8 is None
            and isinstance(self.dispatcher, LocalDispatcher)
        )

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts, shared experts and the weighted sum in one kernel
        (dsmesh.kernels.moe_fused); the shared MLP rides along as extra experts of the same
        width."""
        from dsmesh.kernels.moe_fused import fused_moe

        weights, physical = self.route(x)
        if self.load_recorder is not None:
            self.load_recorder.record(self.moe_layer_idx, physical)
        ex, mlp = self.experts, self.shared_experts
        fits = mlp is not None and not mlp.fp8
        if fits and mlp.gate_proj.weight.shape[0] % ex.intermediate_size == 0:
            shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
            return fused_moe(x, ex.w13, ex.w2, physical, weights, shared=shared)
        add = mlp(x) if mlp is not None else None
        return fused_moe(x, ex.w13, ex.w2, physical, weights, add=add)

    # The three phases, so two micro-batches can interleave (two-batch overlap): while one
    # micro-batch's tokens travel, the other computes.

    def start(self, x: torch.Tensor) -> Pending:
        """Route and start dispatching ``x`` [T, hidden]."""
        weights, physical = self.route(x)
        if self.load_recorder is not None:
            self.load_recorder.record(self.moe_layer_idx, physical)
        return self.dispatcher.dispatch_start(x, physical, weights)

    def compute(self, pending_dispatch: Pending) -> Pending:
        """Wait for this rank's tokens, run its experts, start sending results back."""
        dispatched: DispatchOutput = pending_dispatch.wait()
        if dispatched.expert_ids is not None:
            fused = self.kernels.fused_moe
            expert_out = self.experts.forward_rows(dispatched.hidden, dispatched.expert_ids, fused)
        else:
            assert dispatched.tokens_per_expert is not None
            expert_out = self.experts(dispatched.hidden, dispatched.tokens_per_expert)
        return self.dispatcher.combine_start(expert_out, dispatched)

    def finish(self, x: torch.Tensor, pending_combine: Pending) -> torch.Tensor:
        """Shared experts on ``x`` (overlapping the combine), then the routed sum."""
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = pending_combine.wait()
        return out if shared is None else out + shared
