"""``dsmesh up``'s memory plan: every engine process's memory on every GPU (or on the host),
computed from the model's shape before any engine starts (pure, no torch device).

Each process on a GPU gets its share of ``--mem-fraction`` (split evenly between the
processes of the GPU, dsmesh/cli/placement.py) for its weights and KV pool; the rest of the GPU
holds every process's CUDA context, CUDA graphs and activations. Each process's limits are the
ones it will derive itself (dsmesh/engine/derived.py), so the plan and the engines agree. A plan
that cannot fit is refused with the numbers and the flags that would make it fit, instead of
an out-of-memory error minutes later.

On a CPU mesh the processes' weights, KV pools and activations must fit the host's available
memory (``MemAvailable``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsmesh.cli.placement import EngineInstance, Placement
from dsmesh.engine.derived import DeviceFacts, MemoryPlanError, cache_bytes, derive, dtype_bytes
from dsmesh.engine.footprint import (
    CPU_RUNTIME_BYTES,
    RUNTIME_BYTES,
    activation_bytes,
    graph_bytes,
    graph_count,
    kv_bytes_per_token,
    weight_bytes,
)
from dsmesh.engine.kv.budget import CPU_MAX_TOTAL_TOKENS
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.options import EngineConfig

GIB = 1 << 30
HOST_HEADROOM = 0.9  # of MemAvailable: the rest for the gateway, broker and the page cache

__all__ = ["MemoryPlan", "MemoryPlanError", "ProcessMemory", "plan_cpu", "plan_gpus"]


@dataclass(frozen=True)
class ProcessMemory:
    """One engine process's planned memory, in bytes."""

    name: str  # "decode-0", "decode-0/rank1"
    device: str  # a GPU id, or "host"
    share: float  # its part of the device for weights + KV (GPU only)
    weights: int
    kv_pool: int
    kv_tokens: int
    activations: int
    graphs: int
    runtime: int
    kv_per_token: int
    config: EngineConfig  # with its derived limits

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.activations + self.graphs + self.runtime

    def kv_min(self, max_context: int) -> int:
        """One full-context request's KV: the least an engine's pool must hold."""
        return self.kv_per_token * max_context

    def line(self) -> str:
        return (
            f"{self.name:<14} weights {self.weights / GIB:6.1f} GiB  KV {self.kv_pool / GIB:6.1f}"
            f" GiB ({self.kv_tokens} tokens)  activations {self.activations / GIB:4.1f}  graphs "
            f"{self.graphs / GIB:4.1f}  context {self.runtime / GIB:3.1f}  = "
            f"{self.total / GIB:6.1f} GiB"
        )


@dataclass(frozen=True)
class MemoryPlan:
    processes: tuple[ProcessMemory, ...]
    device_bytes: Mapping[str, int]  # what each device (GPU id, "host") offers

    def lines(self) -> list[str]:
        out = []
        for device, total in self.device_bytes.items():
            procs = [p for p in self.processes if p.device == device]
            used = sum(p.total for p in procs)
            label = "host" if device == "host" else f"GPU {device}"
            out.append(f"  {label}: {used / GIB:.1f} of {total / GIB:.1f} GiB planned")
            out += [f"    {p.line()}" for p in procs]
        return out


def _process(
    name: str,
    device: str,
    engine: EngineConfig,
    mc: ModelConfig,
    facts: DeviceFacts,
    share: float,
    expert_share: float,
) -> ProcessMemory:
    resolved = derive(
        dataclasses.replace(engine, mem_fraction=share if facts.kind == "cuda" else None),
        mc,
        facts,
        expert_share,
    ).config
    dbytes = dtype_bytes(resolved, facts)
    mtp = mc.num_nextn_predict_layers if resolved.speculative == "mtp" else 0
    weights = weight_bytes(
        mc, dbytes, bool(resolved.fp8_experts), mtp, expert_share, bool(resolved.fp8_linears)
    ).total
    per_token = kv_bytes_per_token(mc, cache_bytes(resolved, mc, dbytes), mtp)
    if resolved.max_total_tokens is not None:
        tokens = resolved.max_total_tokens
    elif facts.kind == "cuda":
        tokens = max(int(facts.total_bytes * share) - weights, 0) // per_token
        tokens = min(tokens, resolved.max_running_requests * mc.max_position_embeddings)
    else:
        tokens = CPU_MAX_TOTAL_TOKENS
    tokens = tokens // resolved.page_size * resolved.page_size
    batch = resolved.max_batch_tokens
    activations = activation_bytes(mc, batch, dbytes, min(resolved.max_running_requests, batch))
    graphs = 0
    if facts.kind == "cuda" and resolved.cuda_graphs and resolved.role != "prefill":
        gb = resolved.cuda_graph_max_batch
        graphs = graph_bytes(mc, gb, graph_count(gb), dbytes)
    runtime = RUNTIME_BYTES if facts.kind == "cuda" else CPU_RUNTIME_BYTES
    return ProcessMemory(
        name, device, share, weights, tokens * per_token, tokens, activations, graphs, runtime,
        per_token, resolved,
    )  # fmt: skip


def plan_gpus(
    instances: Sequence[EngineInstance],
    placement: Placement,
    engine: EngineConfig,
    mc: ModelConfig,
    gpu_bytes: Mapping[str, int],
    mem_fraction: float,
    fp8_kernels: bool = True,
) -> MemoryPlan:
    """The plan of a CUDA mesh; raises :class:`MemoryPlanError` when it cannot fit."""
    procs: list[ProcessMemory] = []
    for inst in instances:
        share = placement.mem_fraction(inst.name, mem_fraction)
        expert_share = 1.0 / inst.num_ranks
        config = dataclasses.replace(engine, role=inst.role)
        if inst.role == "prefill":
            config = dataclasses.replace(config, cuda_graphs=False)
        for rank, gpu in enumerate(placement.gpu_ids[inst.name]):
            name = inst.name if inst.num_ranks == 1 else f"{inst.name}/rank{rank}"
            facts = DeviceFacts("cuda", gpu_bytes[gpu], fp8_kernels)
            procs.append(_process(name, gpu, config, mc, facts, share, expert_share))
    plan = MemoryPlan(tuple(procs), {g: gpu_bytes[g] for g in placement.processes_per_gpu
                                     if placement.processes_per_gpu[g]})  # fmt: skip
    _check_gpus(plan, instances, mc, mem_fraction)
    return plan


def plan_cpu(
    instances: Sequence[EngineInstance], engine: EngineConfig, mc: ModelConfig, host_bytes: int
) -> MemoryPlan:
    """The plan of a CPU mesh against the host's available memory (0: unknown, no check)."""
    facts = DeviceFacts("cpu")
    procs = []
    for inst in instances:
        config = dataclasses.replace(engine, role=inst.role)
        for rank in range(inst.num_ranks):
            name = inst.name if inst.num_ranks == 1 else f"{inst.name}/rank{rank}"
            procs.append(_process(name, "host", config, mc, facts, 1.0, 1.0 / inst.num_ranks))
    plan = MemoryPlan(tuple(procs), {"host": host_bytes})
    need = sum(p.total for p in procs)
    if host_bytes and need > host_bytes * HOST_HEADROOM:
        big = max(procs, key=lambda p: p.kv_pool)
        raise MemoryPlanError(
            f"the engine processes need {need / GIB:.1f} GiB but this host has "
            f"{host_bytes / GIB:.1f} GiB available ({HOST_HEADROOM:.0%} usable):\n"
            + "\n".join(plan.lines())
            + f"\nfixes: a smaller --max-total-tokens ({big.name}'s KV pool of "
            f"{big.kv_tokens} tokens takes {big.kv_pool / GIB:.1f} GiB), or fewer instances "
            "(--prefill/--decode/--unified)"
        )
    return plan


def _check_gpus(
    plan: MemoryPlan, instances: Sequence[EngineInstance], mc: ModelConfig, mem_fraction: float
) -> None:
    problems: list[str] = []
    for p in plan.processes:
        room = int(plan.device_bytes[p.device] * p.share)
        least = p.kv_min(mc.max_position_embeddings)
        if p.config.max_total_tokens is None and p.weights + least > room:
            problems.append(
                f"{p.name}: weights {p.weights / GIB:.1f} GiB + one full-context request's KV "
                f"{least / GIB:.1f} GiB exceed its share of GPU {p.device} "
                f"({p.share:.3g} x {plan.device_bytes[p.device] / GIB:.1f} = {room / GIB:.1f} GiB)"
            )
    for gpu, total in plan.device_bytes.items():
        procs = [p for p in plan.processes if p.device == gpu]
        used = sum(p.total for p in procs)
        if used > total:
            problems.append(
                f"GPU {gpu}: {len(procs)} process(es) need {used / GIB:.1f} GiB of "
                f"{total / GIB:.1f} GiB"
            )
    if not problems:
        return
    raise MemoryPlanError(
        "the mesh does not fit in GPU memory:\n  "
        + "\n  ".join(problems)
        + "\nplan:\n"
        + "\n".join(plan.lines())
        + "\nfixes: "
        + "; ".join(_fixes(plan, instances, mc, mem_fraction))
    )


def _fixes(
    plan: MemoryPlan, instances: Sequence[EngineInstance], mc: ModelConfig, mem_fraction: float
) -> list[str]:
    fixes = []
    roles = {i.role for i in instances}
    shared = any(
        len({p.name.split("/")[0] for p in plan.processes if p.device == g}) > 1
        for g in plan.device_bytes
    )
    if shared and {"prefill", "decode"} <= roles:
        fixes.append("one unified instance instead of prefill + decode (--prefill 0 --decode 0 "
                     "--unified 1): the weights are held once")  # fmt: skip
        fixes.append("one GPU per role (--prefill-gpus 0 --decode-gpus 1)")
    if mem_fraction < 0.95:
        fixes.append(f"a larger --mem-fraction (now {mem_fraction:g})")
    if mc.quant is not None and not all(p.config.fp8_experts for p in plan.processes):
        fixes.append("routed experts in FP8 (--fp8-experts)")
    fixes.append("expert parallelism over more GPUs (--ep-size N)")
    if any(p.config.kv_cache_dtype == "auto" for p in plan.processes):
        fixes.append("the KV cache in FP8 (--kv-cache-dtype fp8_e4m3: about half the bytes)")
    fixes.append("a smaller KV pool (--max-total-tokens N)")
    return fixes
