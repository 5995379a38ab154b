"""Defaults derived from the device, the model and the process's role (pure).

An option left at ``None`` (dsmesh/engine/options.py) gets its value here, once, before
the engine builds anything; an explicit value always wins. The rules (docs/ENGINE.md,
"Derived defaults"):

- **On CPU** the limits stay small: 64 running requests, 2,048-token forwards.
- **On CUDA**, the process's share of the GPU (``mem_fraction``) minus its weights is its KV
  pool, and the headroom beside the share (``1 - mem_fraction`` of the GPU, split like the
  share) holds the CUDA context, the CUDA graphs and one forward's activations:
  - ``max_batch_tokens``, the prefill chunk: the largest of 16,384 / 8,192 / 4,096 / 2,048
    whose activations fit the headroom beside the context and the graphs (V2-Lite on an H200
    takes 16,384; DeepSeek-V3's layers with prefill and decode sharing one H200, 8,192);
  - ``max_running_requests``: 256, the batch where decode on an H200 stops gaining (MLA
    decode reads the cache at 71-89% of the copy rate there, docs/BENCHMARKS.md), fewer when
    the pool holds less than 512 tokens a request; a prefill instance, which only holds
    requests until their KV is handed off, the same;
  - ``cuda_graph_max_batch``: the running-request limit, so every decode batch replays a graph.
- ``prefix_cache``: on in the services (prefill, decode, unified), off offline.
- ``fp8_experts``: on for FP8 checkpoints on CUDA with dsmesh's Triton kernels, where the FP8
  grouped GEMM serves the experts at half the bytes, when the experts tile into whole FP8
  blocks; else off (dequantised at load).
- ``fp8_linears``: as ``fp8_experts`` (the same checkpoints, the same kernels): the dense
  linears the checkpoint stores in FP8 stay FP8 and run block-scaled FP8 GEMMs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from dsmesh.engine.footprint import (
    RUNTIME_BYTES,
    activation_bytes,
    graph_bytes,
    graph_count,
    kv_bytes_per_token,
    weight_bytes,
)
from dsmesh.engine.kv.budget import DEFAULT_MEM_FRACTION
from dsmesh.engine.kv.pool import kv_bytes_per_token as kv_cache_bytes_per_token
from dsmesh.engine.kv.pool import kv_cache_dtype
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.options import EngineConfig

CPU_MAX_RUNNING_REQUESTS = 64
CPU_MAX_BATCH_TOKENS = 2048
GPU_MAX_RUNNING_REQUESTS = 256
BATCH_TOKEN_STEPS = (16384, 8192, 4096, 2048)
MIN_TOKENS_PER_REQUEST = 512  # the pool should hold this many tokens per running request
MIN_RUNNING_REQUESTS = 8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceFacts:
    """What the derivation needs to know of the device the engine runs on."""

    kind: str  # "cuda" | "cpu"
    total_bytes: int = 0  # the GPU's memory (CUDA only)
    fp8_kernels: bool = False  # dsmesh's Triton FP8 grouped GEMM can run here


@dataclass(frozen=True)
class Derivation:
    """The resolved config and, for each derived option, the reason for its value."""

    config: EngineConfig
    reasons: dict[str, str]


def device_facts(device: torch.device, kernels: str = "auto") -> DeviceFacts:
    """The facts of ``device`` as this process sees it (reads the GPU's properties)."""
    if device.type != "cuda":
        return DeviceFacts(kind=device.type)
    from dsmesh.kernels._triton import triton_importable

    total = torch.cuda.get_device_properties(device).total_memory
    return DeviceFacts("cuda", total, fp8_kernels=kernels == "auto" and triton_importable())


def dtype_bytes(config: EngineConfig, device: DeviceFacts) -> int:
    if config.dtype == "auto":
        return 2 if device.kind == "cuda" else 4
    return 4 if config.dtype == "float32" else 2


def cache_bytes(config: EngineConfig, mc: ModelConfig, dbytes: int) -> float:
    """Bytes per cached KV value: the compute dtype's ``dbytes``, or with ``kv_cache_dtype``
    fp8_e4m3 one byte plus the token's two float32 scales spread over its values (584 / 576
    for DeepSeek's latent; dsmesh/engine/kv/pool.py)."""
    if config.kv_cache_dtype == "auto":
        return dbytes
    dim = mc.mla.kv_cache_dim
    values = kv_cache_dtype(config.kv_cache_dtype, torch.bfloat16)  # not "auto": FP8
    return kv_cache_bytes_per_token(dim, values) / dim


def headroom_bytes(total_bytes: int, share: float) -> int:
    """This process's part of the memory beside the weights + KV shares: the GPU's
    ``1 - DEFAULT_MEM_FRACTION`` split in the proportion of its ``share``."""
    return int(total_bytes * share * (1 - DEFAULT_MEM_FRACTION) / DEFAULT_MEM_FRACTION)


def experts_in_whole_blocks(mc: ModelConfig) -> bool:
    """Whether the routed experts' weights tile into whole FP8 blocks (the FP8 grouped GEMM's
    layout); a toy checkpoint's narrow experts do not, and load dequantised."""
    if mc.quant is None:
        return False
    bn, bk = mc.quant.weight_block_size
    inter, hidden = mc.moe.moe_intermediate_size, mc.hidden_size
    return inter % bn == 0 and hidden % bk == 0 and hidden % bn == 0 and inter % bk == 0


def derive(
    config: EngineConfig,
    mc: ModelConfig,
    device: DeviceFacts,
    expert_share: float = 1.0,
) -> Derivation:
    """``config`` with every ``None`` option given its derived value (module docstring).
    ``expert_share``: the fraction of the routed experts this process holds (EP)."""
    reasons: dict[str, str] = {}
    values: dict[str, object] = {}

    def take(name: str, value: object, why: str) -> None:
        if getattr(config, name) is None:
            values[name] = value
            reasons[name] = why

    fp8_checkpoint = mc.quant is not None and mc.quant.method == "fp8"
    whole = fp8_checkpoint and experts_in_whole_blocks(mc)
    fp8 = whole and device.kind == "cuda" and device.fp8_kernels
    if fp8:
        why = "FP8 checkpoint on CUDA"
    elif not fp8_checkpoint:
        why = "not an FP8 checkpoint"
    elif not whole:
        why = "the routed experts are not whole FP8 blocks (dequantised at load)"
    else:
        why = "no FP8 kernels on this device"
    take("fp8_experts", fp8, why)
    take(
        "fp8_linears",
        values.get("fp8_experts", config.fp8_experts),
        "as --fp8-experts",
    )
    take("prefix_cache", config.role != "offline", f"role {config.role}")
    if device.kind != "cuda":
        take("max_running_requests", CPU_MAX_RUNNING_REQUESTS, "CPU")
        take("max_batch_tokens", CPU_MAX_BATCH_TOKENS, "CPU")
        resolved = dataclasses.replace(config, **values)
        take("cuda_graph_max_batch", resolved.max_running_requests, "no graphs on CPU")
        return Derivation(dataclasses.replace(config, **values), reasons)

    share = config.mem_fraction if config.mem_fraction is not None else DEFAULT_MEM_FRACTION
    fp8_experts = values.get("fp8_experts", config.fp8_experts)
    fp8_linears = bool(values.get("fp8_linears", config.fp8_linears))
    dbytes = dtype_bytes(config, device)
    mtp = mc.num_nextn_predict_layers if config.speculative == "mtp" else 0
    weights = weight_bytes(mc, dbytes, bool(fp8_experts), mtp, expert_share, fp8_linears).total
    pool_tokens = (int(device.total_bytes * share) - weights) // max(
        kv_bytes_per_token(mc, cache_bytes(config, mc, dbytes), mtp), 1
    )
    if config.max_total_tokens is not None:
        pool_tokens = config.max_total_tokens
    gib = device.total_bytes / (1 << 30)
    running = max(
        MIN_RUNNING_REQUESTS, min(GPU_MAX_RUNNING_REQUESTS, pool_tokens // MIN_TOKENS_PER_REQUEST)
    )
    take(
        "max_running_requests",
        running,
        f"{gib:.0f} GiB GPU, pool of ~{max(pool_tokens, 0)} tokens",
    )
    running = int(values.get("max_running_requests", config.max_running_requests))
    graphs = config.cuda_graphs and config.role != "prefill"
    graph_batch = running if config.cuda_graph_max_batch is None else config.cuda_graph_max_batch
    take("cuda_graph_max_batch", graph_batch, "the running-request limit")
    headroom = headroom_bytes(device.total_bytes, share)
    graph_mem = graph_bytes(mc, graph_batch, graph_count(graph_batch), dbytes) if graphs else 0
    room = headroom - RUNTIME_BYTES - graph_mem
    chunk = next(
        (
            t
            for t in BATCH_TOKEN_STEPS
            if activation_bytes(mc, t, dbytes, min(running, t)) <= room
        ),
        BATCH_TOKEN_STEPS[-1],
    )
    take(
        "max_batch_tokens",
        chunk,
        f"activations of {chunk} tokens fit the {headroom / (1 << 30):.1f} GiB beside the "
        "weights + KV share",
    )
    return Derivation(dataclasses.replace(config, **values), reasons)


class MemoryPlanError(ValueError):
    """What was asked cannot fit in the device's memory; the message gives the numbers and
    the flags that change them."""


def resolve_engine_config(
    config: EngineConfig, mc: ModelConfig, device: torch.device, expert_share: float = 1.0
) -> EngineConfig:
    """``config`` with its derived options filled for ``device`` (logged with reasons)."""
    derivation = derive(config, mc, device_facts(device, config.kernels), expert_share)
    for name, why in derivation.reasons.items():
        log.info("%s = %s (derived: %s)", name, getattr(derivation.config, name), why)
    return derivation.config


def check_weights_fit(
    config: EngineConfig, mc: ModelConfig, device: torch.device, expert_share: float = 1.0
) -> None:
    """Refuse, before loading, weights that cannot fit this process's share of the GPU
    (with ``--max-total-tokens``: the weights and that pool in the whole GPU)."""
    if device.type != "cuda":
        return
    facts = device_facts(device, config.kernels)
    dbytes = dtype_bytes(config, facts)
    mtp = mc.num_nextn_predict_layers if config.speculative == "mtp" else 0
    weights = weight_bytes(
        mc, dbytes, bool(config.fp8_experts), mtp, expert_share, bool(config.fp8_linears)
    )
    gib = 1 << 30
    if config.max_total_tokens is not None:
        per_token = kv_bytes_per_token(mc, cache_bytes(config, mc, dbytes), mtp)
        need = weights.total + config.max_total_tokens * per_token
        have = facts.total_bytes - RUNTIME_BYTES
        what = f"and a KV pool of {config.max_total_tokens} tokens"
        limit = "the GPU"
    else:
        share = config.mem_fraction if config.mem_fraction is not None else DEFAULT_MEM_FRACTION
        need, have, what = weights.total, int(facts.total_bytes * share), ""
        limit = f"--mem-fraction {share:g} of the GPU"
    if need <= have:
        return
    fixes = ["more GPUs (expert parallelism: --ep-size N)"]
    if mc.quant is not None and not config.fp8_experts:
        fixes.insert(0, f"keep the routed experts in FP8 (--fp8-experts: "
                        f"{weights.routed_experts / gib:.1f} GiB now)")
    if config.max_total_tokens is not None:
        fixes.insert(0, "a smaller --max-total-tokens")
    else:
        fixes.insert(0, "a larger --mem-fraction (fewer processes on this GPU)")
    raise MemoryPlanError(
        f"the weights ({weights.total / gib:.1f} GiB) {what} need {need / gib:.1f} GiB but "
        f"{limit} ({facts.total_bytes / gib:.1f} GiB) gives {have / gib:.1f} GiB: "
        + "; or ".join(fixes)
    )
