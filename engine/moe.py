"""DeepSeekMoE layer: router, routed experts behind a dispatcher, and shared experts.

The layer never assumes where experts live. It routes to *logical* experts, asks the
:class:`ExpertLocation` for a *physical* replica of each, and hands the pairs to a
:class:`MoEDispatcher`; this rank's :class:`RoutedExperts` hold only its own physical experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.expert_location import ExpertLocation
from engine.moe_dispatch import DispatchOutput, MoEDispatcher, Pending
from engine.routing import routing_config, select_experts
from kernels._triton import use_triton
from kernels.fp8 import Fp8ExpertWeights
from kernels.moe_gemm import expert_ffn, expert_ffn_fp8, grouped_mm_supported

__all__ = ["DeepseekMoE", "DenseMLP", "MoEGate", "RoutedExperts", "grouped_mm_supported"]


class DenseMLP(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). Names match the checkpoint."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> router logits [T, n_routed] float32."""
        return F.linear(x.to(torch.float32), self.weight.to(torch.float32))


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
        # The checkpoint's FP8 form of the same experts (kernels.moe_gemm.attach_fp8_experts);
        # on CUDA it replaces the dense weights in forward.
        self.fp8: Fp8ExpertWeights | None = None

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] grouped by local expert; tokens_per_expert [num_local] -> [N, H]."""
        if self.fp8 is not None and hidden.shape[0] and use_triton(hidden):
            return expert_ffn_fp8(hidden, tokens_per_expert, self.fp8)
        if hidden.shape[0] and grouped_mm_supported(hidden.dtype, hidden.device.type):
            return expert_ffn(hidden, tokens_per_expert, self.w13, self.w2)
        return self.forward_reference(hidden, tokens_per_expert)

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
        self.location = location
        self.dispatcher = dispatcher
        self.ep_rank = ep_rank
        self.gate = MoEGate(cfg)
        self.experts = RoutedExperts(
            location.num_local_physical, cfg.hidden_size, cfg.moe.moe_intermediate_size
        )
        self.load_recorder = None  # engine.ep.load_recorder.ExpertLoadRecorder, when set
        self.shared_experts: DenseMLP | None = None
        if cfg.moe.n_shared_experts:
            self.shared_experts = DenseMLP(
                cfg.hidden_size, cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, physical expert ids [T, k] int64)."""
        weights, logical = select_experts(
            self.gate(x), self.routing, self.gate.e_score_correction_bias
        )
        return weights, self.location.to_physical(self.moe_layer_idx, logical, self.ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.finish(x, self.compute(self.start(x)))

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
        expert_out = self.experts(dispatched.hidden, dispatched.tokens_per_expert)
        return self.dispatcher.combine_start(expert_out, dispatched)

    def finish(self, x: torch.Tensor, pending_combine: Pending) -> torch.Tensor:
        """Shared experts on ``x`` (overlapping the combine), then the routed sum."""
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = pending_combine.wait()
        return out if shared is None else out + shared
