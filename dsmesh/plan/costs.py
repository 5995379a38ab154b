"""Step times of one GPU of an instance: a decode step and a prefill forward, per layer as
the larger of bytes over bandwidth and FLOPs over rate (docs/PLAN.md, "Equations").

Every GPU of an instance runs DP attention on its own requests and holds ``(E + R) / ep``
routed experts of every MoE layer; the all-to-all moves routed rows between them. Steps are
lockstep across the ranks, so the slowest rank (the one the placement loads most) sets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dsmesh.plan.hardware import (
    DEEPEP_LL_FIXED_US,
    DEEPEP_NORMAL_NVLINK,
    DEEPEP_NORMAL_SMS,
    GB,
    GPU,
    NCCL_A2A_EFF,
    NCCL_A2A_FIXED_US,
    deepep_low_latency_us,
    deepep_normal_rdma,
)
from dsmesh.plan.overlap import SCHEDULES, LayerPieces, overlapped_ms
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
    tbo_schedule: str = "dsmesh"  # whose TBO order (dsmesh/plan/overlap.py): dsmesh, sglang

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"ep must be at least 1 (got {self.ep})")
        if not 0.0 < self.balancedness <= 1.0:
            raise ValueError(f"balancedness must be in (0, 1] (got {self.balancedness})")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (got {self.backend!r})")
        if self.tbo_schedule not in SCHEDULES:
            raise ValueError(f"tbo_schedule must be one of {SCHEDULES} (got {self.tbo_schedule!r})")

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


def _skew(shape: ModelShape, par: Parallel, rows: float) -> float:
    """The busiest rank's routed rows over the mean, for ``rows`` tokens per rank."""
    mean = rows * shape.experts_per_token
    return max_rank_rows(mean, par.balancedness, par.ep) / mean


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


def decode_comm_parts(
    shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float
) -> tuple[float, float]:
    """Dispatch (FP8) and combine (bf16) of one MoE layer for ``tokens`` per rank, in ms;
    ``skew`` is the most loaded rank's rows over the mean (the receiver that finishes last)."""
    if par.ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    remote = (par.ep - 1) / par.ep
    nbytes = tokens * shape.experts_per_token * shape.hidden * 3.0 * remote * skew
    if par.backend == "nccl":
        link = gpu.nvlink_bytes_s if par.ep <= gpu.gpus_per_node else gpu.rdma_bytes_s
        return _split(NCCL_A2A_FIXED_US / 1e3, 1e3 * nbytes / (link * NCCL_A2A_EFF))
    if par.ep <= gpu.gpus_per_node:  # one NVLink domain
        link = gpu.nvlink_bytes_s * DEEPEP_NORMAL_NVLINK / (160 * GB)
        return _split(DEEPEP_LL_FIXED_US / 1e3, 1e3 * nbytes / link)
    dispatch, combine = deepep_low_latency_us(
        par.ep, tokens * skew, shape.hidden, shape.experts_per_token
    )
    rdma_scale = 50 * GB / gpu.rdma_bytes_s  # the published figures ran on 400 Gb/s NICs
    fixed = DEEPEP_LL_FIXED_US
    return ((dispatch - fixed) * rdma_scale + fixed) / 1e3, (
        (combine - fixed) * rdma_scale + fixed
    ) / 1e3


def _split(fixed_ms: float, bytes_ms: float) -> tuple[float, float]:
    """A fixed latency each, and the bytes' time split 1:2 (FP8 out, bf16 back)."""
    return fixed_ms + bytes_ms / 3.0, fixed_ms + 2.0 * bytes_ms / 3.0


def decode_comm_ms(shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float) -> float:
    """Dispatch + combine of one MoE layer (:func:`decode_comm_parts`)."""
    return sum(decode_comm_parts(shape, gpu, par, tokens, skew))


def prefill_comm_parts(
    shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float
) -> tuple[float, float]:
    """DeepEP's normal kernels (or NCCL) for one MoE layer of ``tokens`` per rank: across
    nodes each token crosses RDMA once per remote node it needs, within a node NVLink."""
    if par.ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    per_token = shape.hidden * 3.0  # FP8 out, bf16 back
    if par.ep <= gpu.gpus_per_node or par.backend == "nccl":
        return decode_comm_parts(shape, gpu, par, tokens, skew)
    nbytes = tokens * per_token * remote_nodes(shape, par.nodes(gpu)) * skew
    bw = deepep_normal_rdma(par.ep) * gpu.rdma_bytes_s / (50 * GB)
    return _split(0.0, 1e3 * nbytes / bw)


def prefill_comm_ms(
    shape: ModelShape, gpu: GPU, par: Parallel, tokens: float, skew: float
) -> float:
    return sum(prefill_comm_parts(shape, gpu, par, tokens, skew))


def _comm_sms(gpu: GPU, par: Parallel, low_latency: bool) -> float:
    """The share of the SMs a transfer holds while in flight: none for the low-latency
    kernels' receive hook, DeepEP's default 20 for its normal kernels (and NCCL's)."""
    return 0.0 if low_latency else min(0.5, DEEPEP_NORMAL_SMS / gpu.sms)


def _low_latency(gpu: GPU, par: Parallel) -> bool:
    return par.backend == "deepep" and par.ep > gpu.gpus_per_node


def decode_step(
    shape: ModelShape,
    gpu: GPU,
    par: Parallel,
    batch: float,
    context: float,
    rows_per_seq: float = 1.0,
) -> StepCost:
    """A captured decode step of ``batch`` sequences at ``context`` cached tokens each on one
    rank; ``rows_per_seq`` > 1 verifies MTP drafts (each sequence brings that many rows).
    With TBO the MoE layers run as two micro-batches in the schedule of dsmesh/plan/overlap.py."""
    k = gpu.kernels
    cost = StepCost()
    if batch <= 0:
        cost.total_ms = cost.other_ms = k.step_ms
        return cost
    full = batch * rows_per_seq
    kv_bytes = shape.kv_dim * shape.kv_bytes
    small = k.layer_us / 1e3

    def layer(rows: float) -> tuple[LayerPieces, float]:
        """A MoE layer's pieces at ``rows`` rows, and a dense layer's time. Each
        micro-batch has its own busiest rank: the sampling noise grows as the rows shrink."""
        skew = _skew(shape, par, rows)
        mla = 1e3 * max(
            rows * context * kv_bytes / rows_per_seq / (gpu.hbm_bytes_s * k.mla_decode_mem_eff),
            rows * shape.decode_attn_flops(context) / (gpu.bf16_flops * k.mla_decode_flop_eff),
        )
        o_params = shape.num_heads * shape.v_head_dim * shape.hidden
        prep = matmul_ms(shape.attn_params - o_params, rows, shape.weight_bytes, gpu)
        core = mla + matmul_ms(o_params, rows, shape.weight_bytes, gpu) + small
        shared = matmul_ms(
            shape.num_shared_experts * shape.expert_params, rows, shape.weight_bytes, gpu
        )
        routed = routed_ms(shape, gpu, par, rows * shape.experts_per_token * skew)
        dispatch, combine = decode_comm_parts(shape, gpu, par, rows, skew)
        sms = _comm_sms(gpu, par, _low_latency(gpu, par))
        dense = prep + core + matmul_ms(shape.dense_ffn_params, rows, shape.weight_bytes, gpu)
        return LayerPieces(prep, core, shared, routed, dispatch, combine, sms), dense

    pieces, dense_ms = layer(full)
    n_dense, n_moe = shape.num_dense_layers, shape.num_moe_layers
    cost.attention_ms = shape.num_layers * (pieces.prep + pieces.core - small)
    cost.moe_ms = n_dense * (dense_ms - pieces.prep - pieces.core) + n_moe * (
        pieces.shared + pieces.routed
    )
    cost.comm_ms = n_moe * (pieces.dispatch + pieces.combine)
    head = matmul_ms(shape.vocab * shape.hidden, full, shape.weight_bytes, gpu)
    cost.other_ms = shape.num_layers * small + head + k.step_ms
    if not par.tbo:
        cost.total_ms = cost.attention_ms + cost.moe_ms + cost.comm_ms + cost.other_ms
        return cost
    half, half_dense = layer(full / 2)
    half, half_dense = _with_tbo_cost(half, half_dense, k.tbo_layer_us / 1e3)
    # SGLang runs the dense layers whole; dsmesh splits them too
    dense = n_dense * (2 * half_dense if par.tbo_schedule == "dsmesh" else dense_ms)
    moe = overlapped_ms(half, n_moe, par.tbo_schedule, "decode")
    cost.total_ms = dense + moe + head + k.step_ms
    _tbo_parts(cost, n_moe, half, pieces)
    return cost


def _with_tbo_cost(half: LayerPieces, dense: float, ms: float) -> tuple[LayerPieces, float]:
    """A micro-batch's layer with what TBO adds beyond its pieces (Kernels.tbo_layer_us)."""
    return replace(half, core=half.core + ms), dense + ms


def _tbo_parts(cost: StepCost, n_moe: int, half: LayerPieces, whole: LayerPieces) -> None:
    """Under TBO the halves' compute is charged to its parts and the communication TBO did
    not hide shows as the rest."""
    extra_attn = n_moe * (2 * (half.prep + half.core) - (whole.prep + whole.core))
    extra_moe = n_moe * (2 * (half.shared + half.routed) - (whole.shared + whole.routed))
    cost.attention_ms += max(0.0, extra_attn)
    cost.moe_ms += max(0.0, extra_moe)
    cost.comm_ms = max(0.0, cost.total_ms - cost.attention_ms - cost.moe_ms - cost.other_ms)


def prefill_step(
    shape: ModelShape,
    gpu: GPU,
    par: Parallel,
    tokens: float,
    prompt_len: float,
    cached: float = 0.0,
) -> StepCost:
    """One prefill forward of ``tokens`` new tokens on one rank, in chunks of ``prompt_len``
    new tokens each after ``cached`` tokens of the same prompt. With TBO the MoE layers run
    as two micro-batches of half the prompts each (dsmesh/plan/overlap.py)."""
    k = gpu.kernels
    cost = StepCost()
    if tokens <= 0:
        return cost
    other = 1.0 + k.prefill_other

    def layer(t: float) -> tuple[LayerPieces, float]:
        skew = _skew(shape, par, t)
        chunk = min(prompt_len, t)
        mla = (
            1e3
            * (t / chunk)
            * shape.prefill_attn_flops(chunk, cached)
            / (gpu.bf16_flops * k.mla_prefill_eff)
        )
        o_params = shape.num_heads * shape.v_head_dim * shape.hidden
        prep = matmul_ms(shape.attn_params - o_params, t, shape.weight_bytes, gpu) * other
        core = (mla + matmul_ms(o_params, t, shape.weight_bytes, gpu)) * other
        shared = (
            matmul_ms(shape.num_shared_experts * shape.expert_params, t, shape.weight_bytes, gpu)
            * other
        )
        routed = routed_ms(shape, gpu, par, t * shape.experts_per_token * skew) * other
        dispatch, combine = prefill_comm_parts(shape, gpu, par, t, skew)
        sms = _comm_sms(gpu, par, low_latency=False)
        dense = prep + core + matmul_ms(shape.dense_ffn_params, t, shape.weight_bytes, gpu) * other
        return LayerPieces(prep, core, shared, routed, dispatch, combine, sms), dense

    pieces, dense_ms = layer(tokens)
    n_dense, n_moe = shape.num_dense_layers, shape.num_moe_layers
    head = matmul_ms(
        shape.vocab * shape.hidden, tokens / min(prompt_len, tokens), shape.weight_bytes, gpu
    )
    cost.attention_ms = shape.num_layers * (pieces.prep + pieces.core) / other
    cost.moe_ms = (
        n_dense * (dense_ms - pieces.prep - pieces.core) + n_moe * (pieces.shared + pieces.routed)
    ) / other
    cost.comm_ms = n_moe * (pieces.dispatch + pieces.combine)
    compute = n_dense * dense_ms + n_moe * (
        pieces.prep + pieces.core + pieces.shared + pieces.routed
    )
    if not par.tbo:
        cost.total_ms = compute + cost.comm_ms + head + k.step_ms
        cost.other_ms = cost.total_ms - cost.attention_ms - cost.moe_ms - cost.comm_ms
        return cost
    half, half_dense = layer(tokens / 2)
    half, half_dense = _with_tbo_cost(half, half_dense, k.tbo_layer_us / 1e3)
    dense = n_dense * (2 * half_dense if par.tbo_schedule == "dsmesh" else dense_ms)
    moe = overlapped_ms(half, n_moe, par.tbo_schedule, "prefill")
    cost.total_ms = dense + moe + head + k.step_ms
    cost.other_ms = (compute - (cost.attention_ms + cost.moe_ms)) + head + k.step_ms
    _tbo_parts(cost, n_moe, half, pieces)
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
