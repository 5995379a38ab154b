"""Step times of one GPU of an instance: a decode step and a prefill forward, per layer as
the larger of bytes over bandwidth and FLOPs over rate (docs/PLAN.md, "Equations").

Every GPU of an instance runs DP attention on its own requests and holds ``(E + R) / ep``
routed experts of every MoE layer; the all-to-all moves routed rows between them. Steps are
lockstep across the ranks, so the slowest rank (the one the placement loads most) sets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsmesh.plan.hardware import (
    DEEPEP_NORMAL_NVLINK,
    GB,
    GPU,
    NCCL_A2A_EFF,
    NCCL_A2A_FIXED_US,
    deepep_low_latency_us,
    deepep_normal_rdma,
)
from dsmesh.plan.shapes import ModelShape

BACKENDS = ("deepep", "nccl")


@dataclass(frozen=True)
class Parallel:
    """How one instance spreads the model: ``ep`` GPUs, each with DP attention."""

    ep: int = 1
    redundant: int = 0  # redundant expert slots per MoE layer (EPLB)
    balancedness: float = 1.0  # mean / max per-rank routed load of the placement
    tbo: bool = False  # two-batch overlap
    backend: str = "deepep"  # all-to-all: DeepEP's kernels, or torch's over NCCL
    tbo_overlap: float = 0.5  # share of the shorter of compute and communication TBO hides

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"ep must be at least 1 (got {self.ep})")
        if not 0.0 < self.balancedness <= 1.0:
            raise ValueError(f"balancedness must be in (0, 1] (got {self.balancedness})")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (got {self.backend!r})")

    def nodes(self, gpu: GPU) -> int:
        return max(1, math.ceil(self.ep / gpu.gpus_per_node))


@dataclass
class StepCost:
    """One step of one GPU, in milliseconds, by part (a part's total over the layers)."""

    total_ms: float = 0.0
    attention_ms: float = 0.0  # attention projections and the attention kernel
    moe_ms: float = 0.0  # routed and shared experts, dense FFNs
    comm_ms: float = 0.0  # all-to-all dispatch and combine
    other_ms: float = 0.0  # per-layer small kernels, LM head, the step's fixed cost

    @property
    def bound(self) -> str:
        """The part that sets the step: communication when TBO cannot hide it."""
        named = {"attention": self.attention_ms, "experts": self.moe_ms, "all-to-all": self.comm_ms}
        return max(named, key=named.__getitem__)


def _gemm_rate(wbytes: float, gpu: GPU, grouped: bool = False) -> float:
    """FLOP/s of the math once the weights are in: FP8 weights on the FP8 rate, else bf16."""
    k = gpu.kernels
    if wbytes <= 1.0:
        return gpu.fp8_flops * k.gemm_eff
    return gpu.bf16_flops * (k.grouped_bf16_eff if grouped else k.matmul_eff)


def matmul_ms(params: float, rows: float, wbytes: float, gpu: GPU) -> float:
    """A weight of ``params`` applied to ``rows`` rows: reading it, then the math (the sum,
    not the larger: it is what the grouped GEMMs measured at 128 and 512 rows per expert)."""
    if params <= 0 or rows <= 0:
        return 0.0
    mem = params * wbytes / (gpu.hbm_bytes_s * gpu.kernels.copy_eff)
    return 1e3 * (mem + 2.0 * params * rows / _gemm_rate(wbytes, gpu))


def max_rank_rows(mean_rows: float, balancedness: float, ep: int) -> float:
    """Routed rows of the most loaded rank: the placement's imbalance, then the sampling
    noise of one step (the maximum of ``ep`` Poisson counts, about mean + sqrt(2 ln ep · mean))."""
    if ep <= 1:
        return mean_rows
    base = mean_rows / balancedness
    return base + math.sqrt(2.0 * math.log(ep) * max(base, 1.0))


def routed_ms(shape: ModelShape, gpu: GPU, par: Parallel, rows: float) -> float:
    """The routed experts of one MoE layer on the most loaded rank, ``rows`` routed rows."""
    slots = (shape.num_experts + par.redundant) / par.ep
    per_expert = rows / slots
    touched = slots * (1.0 - math.exp(-per_expert))  # experts that receive any row
    mem = touched * shape.expert_params * shape.expert_bytes
    mem_s = mem / (gpu.hbm_bytes_s * gpu.kernels.copy_eff)
    return 1e3 * (
        mem_s + 2.0 * shape.expert_params * rows / _gemm_rate(shape.expert_bytes, gpu, True)
    )


def remote_nodes(shape: ModelShape, nodes: int) -> float:
    """Expected nodes other than its own that one token's routed experts live on, with
    node-limited routing (``groups_per_token`` of ``num_groups`` groups, groups spread evenly
    over the nodes) or, without groups, ``experts_per_token`` independent picks."""
    if nodes <= 1:
        return 0.0
    if shape.num_groups > 1 and shape.num_groups % nodes == 0:
        per_node = shape.num_groups // nodes
        miss = math.comb(shape.num_groups - per_node, shape.groups_per_token) / math.comb(
            shape.num_groups, shape.groups_per_token
        )
        distinct = nodes * (1.0 - miss)
    else:
        distinct = nodes * (1.0 - (1.0 - 1.0 / nodes) ** shape.experts_per_token)
    return distinct * (nodes - 1) / nodes


def decode_comm_ms(shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float) -> float:
    """Dispatch (FP8) + combine (bf16) of one MoE layer for ``tokens`` per rank; ``skew`` is
    the most loaded rank's rows over the mean (the receiver that finishes last)."""
    if par.ep <= 1 or tokens <= 0:
        return 0.0
    remote = (par.ep - 1) / par.ep
    nbytes = tokens * shape.experts_per_token * shape.hidden * 3.0 * remote * skew
    if par.backend == "nccl":
        link = gpu.nvlink_bytes_s if par.ep <= gpu.gpus_per_node else gpu.rdma_bytes_s
        return 2 * NCCL_A2A_FIXED_US / 1e3 + 1e3 * nbytes / (link * NCCL_A2A_EFF)
    if par.ep <= gpu.gpus_per_node:  # one NVLink domain
        link = gpu.nvlink_bytes_s * DEEPEP_NORMAL_NVLINK / (160 * GB)
        return 2 * 0.02 + 1e3 * nbytes / link
    dispatch, combine = deepep_low_latency_us(
        par.ep, tokens * skew, shape.hidden, shape.experts_per_token
    )
    rdma_scale = 50 * GB / gpu.rdma_bytes_s  # the published figures ran on 400 Gb/s NICs
    fixed = 2 * 20.0
    return ((dispatch + combine - fixed) * rdma_scale + fixed) / 1e3


def prefill_comm_ms(
    shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float
) -> float:
    """DeepEP's normal kernels (or NCCL) for one MoE layer of ``tokens`` per rank: across
    nodes each token crosses RDMA once per remote node it needs, within a node NVLink."""
    if par.ep <= 1 or tokens <= 0:
        return 0.0
    per_token = shape.hidden * 3.0  # FP8 out, bf16 back
    if par.ep <= gpu.gpus_per_node or par.backend == "nccl":
        return decode_comm_ms(shape, gpu, par, tokens, skew)
    nbytes = tokens * per_token * remote_nodes(shape, par.nodes(gpu)) * skew
    bw = deepep_normal_rdma(par.ep) * gpu.rdma_bytes_s / (50 * GB)
    return 1e3 * nbytes / bw


def _overlap(compute: float, comm: float, par: Parallel) -> float:
    return max(compute, comm) + (1.0 - par.tbo_overlap) * min(compute, comm)


def decode_step(
    shape: ModelShape,
    gpu: GPU,
    par: Parallel,
    batch: float,
    context: float,
    rows_per_seq: float = 1.0,
) -> StepCost:
    """A captured decode step of ``batch`` sequences at ``context`` cached tokens each on one
    rank; ``rows_per_seq`` > 1 verifies MTP drafts (each sequence brings that many rows)."""
    k = gpu.kernels
    cost = StepCost()
    if batch <= 0:
        cost.total_ms = cost.other_ms = k.step_ms
        return cost
    halves = 2 if par.tbo else 1
    rows = batch * rows_per_seq / halves
    skew = max_rank_rows(rows * shape.experts_per_token * halves, par.balancedness, par.ep) / (
        rows * shape.experts_per_token * halves
    )
    kv_bytes = shape.kv_dim * shape.kv_bytes
    mla = 1e3 * max(
        rows * context * kv_bytes / rows_per_seq / (gpu.hbm_bytes_s * k.mla_decode_mem_eff),
        rows * shape.decode_attn_flops(context) / (gpu.bf16_flops * k.mla_decode_flop_eff),
    )
    attn = matmul_ms(shape.attn_params, rows, shape.weight_bytes, gpu) + mla
    dense = matmul_ms(shape.dense_ffn_params, rows, shape.weight_bytes, gpu)
    shared = matmul_ms(
        shape.num_shared_experts * shape.expert_params, rows, shape.weight_bytes, gpu
    )
    routed_rows = rows * shape.experts_per_token * skew
    moe = shared + routed_ms(shape, gpu, par, routed_rows)
    comm = decode_comm_ms(shape, gpu, par, rows, skew)
    small = k.layer_us / 1e3
    n_dense, n_moe = shape.num_dense_layers, shape.num_moe_layers
    dense_layer = halves * (attn + dense + small)
    moe_compute = halves * (attn + moe + small)
    moe_comm = halves * comm
    moe_layer = _overlap(moe_compute, moe_comm, par) if par.tbo else moe_compute + moe_comm
    head = matmul_ms(shape.vocab * shape.hidden, batch * rows_per_seq, shape.weight_bytes, gpu)
    cost.attention_ms = shape.num_layers * halves * attn
    cost.moe_ms = n_dense * halves * dense + n_moe * halves * moe
    cost.comm_ms = n_moe * moe_comm
    cost.other_ms = shape.num_layers * halves * small + head + k.step_ms
    cost.total_ms = n_dense * dense_layer + n_moe * moe_layer + head + k.step_ms
    if par.tbo:  # what TBO hid shows as the communication it did not
        cost.comm_ms = max(0.0, cost.total_ms - (cost.attention_ms + cost.moe_ms + cost.other_ms))
    return cost


def prefill_step(
    shape: ModelShape,
    gpu: GPU,
    par: Parallel,
    tokens: float,
    prompt_len: float,
    cached: float = 0.0,
) -> StepCost:
    """One prefill forward of ``tokens`` new tokens on one rank, in chunks of ``prompt_len``
    new tokens each after ``cached`` tokens of the same prompt."""
    k = gpu.kernels
    cost = StepCost()
    if tokens <= 0:
        return cost
    halves = 2 if par.tbo else 1
    t = tokens / halves
    skew = max_rank_rows(tokens * shape.experts_per_token, par.balancedness, par.ep) / (
        tokens * shape.experts_per_token
    )
    chunk = min(prompt_len, t)
    mla = (
        1e3
        * (t / chunk)
        * shape.prefill_attn_flops(chunk, cached)
        / (gpu.bf16_flops * k.mla_prefill_eff)
    )
    attn = matmul_ms(shape.attn_params, t, shape.weight_bytes, gpu) + mla
    dense = matmul_ms(shape.dense_ffn_params, t, shape.weight_bytes, gpu)
    shared = matmul_ms(shape.num_shared_experts * shape.expert_params, t, shape.weight_bytes, gpu)
    moe = shared + routed_ms(shape, gpu, par, t * shape.experts_per_token * skew)
    comm = prefill_comm_ms(shape, gpu, par, t, skew)
    other = 1.0 + k.prefill_other
    n_dense, n_moe = shape.num_dense_layers, shape.num_moe_layers
    moe_compute = halves * (attn + moe) * other
    moe_comm = halves * comm
    moe_layer = _overlap(moe_compute, moe_comm, par) if par.tbo else moe_compute + moe_comm
    head = matmul_ms(shape.vocab * shape.hidden, tokens / chunk, shape.weight_bytes, gpu)
    cost.attention_ms = shape.num_layers * halves * attn
    cost.moe_ms = n_dense * halves * dense + n_moe * halves * moe
    cost.comm_ms = n_moe * moe_comm
    cost.total_ms = n_dense * halves * (attn + dense) * other + n_moe * moe_layer + head + k.step_ms
    cost.other_ms = cost.total_ms - cost.attention_ms - cost.moe_ms - cost.comm_ms
    if par.tbo:
        cost.comm_ms = max(0.0, cost.total_ms - (cost.attention_ms + cost.moe_ms) * other - head)
    return cost


def weight_bytes_per_gpu(shape: ModelShape, par: Parallel) -> float:
    """Weights one rank holds: everything but the routed experts, and its expert slots."""
    routed = shape.num_experts * shape.expert_params * shape.expert_bytes * shape.num_moe_layers
    slots = (shape.num_experts + par.redundant) / par.ep
    return shape.weight_bytes_total() - routed + routed * slots / shape.num_experts


def kv_capacity_tokens(
    shape: ModelShape, gpu: GPU, par: Parallel, mem_fraction: float = 0.85
) -> int:
    """KV tokens one rank's pool holds: ``mem_fraction`` of its memory less its weights
    (the engine's sizing, dsmesh/engine/kv/budget.py); 0 when the weights do not fit."""
    free = gpu.memory_gib * 2**30 * mem_fraction - weight_bytes_per_gpu(shape, par)
    return max(0, int(free / shape.kv_bytes_per_token))
