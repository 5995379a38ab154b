"""Dispatch/combine through DeepEP's NVLink/RDMA kernels (``deep_ep``, an optional GPU extra).

Two modes, fixed per instance because every rank of a group must use the same one:
- **normal** (prefill, offline): each token goes once to every rank that holds one of its
  experts; the rank expands it to (token, local expert) rows, and combine sums the
  weighted expert outputs per received token before DeepEP sums them across ranks.
- **low-latency** (decode): DeepEP's IBGDA kernels send (token, expert) rows straight into
  per-expert slots, in FP8 (dequantised here for the bf16 experts), and its combine applies
  the routing weights.

Both implement :class:`~dsmesh.engine.model.moe_dispatch.MoEDispatcher`, so the MoE layer is
unchanged. ``deep_ep`` is imported lazily; :func:`deepep_available` says whether it can be used.

Status: written against deep_ep 1.0.0's documented API; it has not run yet: no machine it was
tried on has had a DeepEP build (see docs/EP.md). The all-to-all backend is the one
that is tested.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsmesh.engine.model.moe_dispatch import DispatchOutput, MoEDispatcher
from dsmesh.kernels.libraries import status as library_status

DEEPEP_MODES = ("normal", "low_latency")


def deepep_available(device: torch.device) -> tuple[bool, str]:
    """(usable, why): deep_ep is installed as a build for this torch (dsmesh.kernels.libraries:
    checked from its metadata before it is imported), imports, the group runs on NCCL, and
    the GPU is Hopper+."""
    if importlib.util.find_spec("deep_ep") is None:
        return False, "deep_ep is not installed"
    installed = library_status("deep_ep")
    if not installed.usable:
        return False, installed.detail
    try:
        import deep_ep  # noqa: F401
    except ImportError as exc:
        return False, f"deep_ep does not import ({exc}): {installed.detail}"
    if device.type != "cuda":
        return False, "DeepEP needs CUDA"
    if dist.get_backend() != "nccl":
        return False, "DeepEP needs an NCCL process group"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False, "DeepEP's kernels are built for Hopper (sm90) and newer"
    return True, "available"


@dataclass
class _NormalHandle:
    deep_handle: tuple
    token_of_row: torch.Tensor  # [N] received-token index of each (token, expert) row
    weight_of_row: torch.Tensor  # [N] float32
    num_received: int


class DeepEPNormalDispatcher(MoEDispatcher):
    """High-throughput mode: tokens de-duplicated per rank, expanded per local expert here."""

    def __init__(self, num_local: int, num_physical: int, hidden_size: int, group=None) -> None:
        import deep_ep

        self.num_local = num_local
        self.num_physical = num_physical
        group = group or dist.group.WORLD
        size = dist.get_world_size(group)
        hidden_bytes = hidden_size * 2  # bf16 rows
        nvl_bytes = max(
            deep_ep.Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(hidden_bytes, size),
            deep_ep.Buffer.get_combine_config(size).get_nvl_buffer_size_hint(hidden_bytes, size),
        )
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=0)

    def dispatch(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchOutput:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            physical_ids, self.num_physical
        )
        recv_x, recv_ids, recv_w, _, deep_handle, _ = self.buffer.dispatch(
            hidden.to(torch.bfloat16),
            topk_idx=physical_ids,
            topk_weights=weights.to(torch.float32),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        valid = recv_ids >= 0  # [N_recv, k]: local expert index, -1 where not this rank's
        token = torch.arange(recv_ids.shape[0], device=recv_ids.device)[:, None]
        token = token.expand_as(recv_ids)[valid]
        expert = recv_ids[valid]
        order = torch.argsort(expert, stable=True)
        handle = _NormalHandle(
            deep_handle, token[order], recv_w[valid][order].float(), recv_x.shape[0]
        )
        rows = recv_x.index_select(0, token[order]).to(hidden.dtype)
        return DispatchOutput(rows, torch.bincount(expert, minlength=self.num_local), handle)

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h = dispatched.handle
        assert isinstance(h, _NormalHandle)
        per_token = torch.zeros(
            (h.num_received, expert_out.shape[1]), dtype=torch.float32, device=expert_out.device
        )
        per_token.index_add_(0, h.token_of_row, expert_out.float() * h.weight_of_row[:, None])
        combined, _, _ = self.buffer.combine(per_token.to(torch.bfloat16), h.deep_handle)
        return combined.to(expert_out.dtype)


@dataclass
class _LowLatencyHandle:
    deep_handle: tuple
    physical_ids: torch.Tensor
    weights: torch.Tensor
    counts: list[int]
    slots: int


class DeepEPLowLatencyDispatcher(MoEDispatcher):
    """Decode mode: at most ``max_tokens_per_rank`` tokens per rank per step (the decode
    batch, halved under two-batch overlap); rows arrive per expert, in FP8."""

    def __init__(
        self,
        num_local: int,
        num_physical: int,
        hidden_size: int,
        max_tokens_per_rank: int,
        group=None,
    ) -> None:
        import deep_ep

        self.num_local = num_local
        self.num_physical = num_physical
        self.max_tokens = max_tokens_per_rank
        group = group or dist.group.WORLD
        size = dist.get_world_size(group)
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            max_tokens_per_rank, hidden_size, size, num_physical
        )
        self.buffer = deep_ep.Buffer(
            group,
            num_rdma_bytes=rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=num_local,
        )

    def dispatch(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchOutput:
        if hidden.shape[0] > self.max_tokens:
            raise RuntimeError(
                f"{hidden.shape[0]} tokens exceed DeepEP low-latency capacity {self.max_tokens}"
            )
        (fp8, scales), recv_count, deep_handle, _, _ = self.buffer.low_latency_dispatch(
            hidden.to(torch.bfloat16), physical_ids, self.max_tokens, self.num_physical
        )
        counts = recv_count.tolist()
        slots = fp8.shape[1]
        rows = []
        for e, n in enumerate(counts):  # valid rows lead each expert's block
            block = fp8[e, :n].float() * scales[e, :n].repeat_interleave(128, dim=-1)
            rows.append(block.to(hidden.dtype))
        handle = _LowLatencyHandle(deep_handle, physical_ids, weights.float(), counts, slots)
        hidden_rows = torch.cat(rows) if rows else hidden.new_zeros((0, hidden.shape[1]))
        return DispatchOutput(
            hidden_rows, torch.tensor(counts, dtype=torch.int64, device=hidden.device), handle
        )

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h = dispatched.handle
        assert isinstance(h, _LowLatencyHandle)
        packed = expert_out.new_zeros(
            (self.num_local, h.slots, expert_out.shape[1]), dtype=torch.bfloat16
        )
        start = 0
        for e, n in enumerate(h.counts):
            packed[e, :n] = expert_out[start : start + n].to(torch.bfloat16)
            start += n
        combined, _, _ = self.buffer.low_latency_combine(
            packed, h.physical_ids, h.weights, h.deep_handle
        )
        return combined.to(expert_out.dtype)
