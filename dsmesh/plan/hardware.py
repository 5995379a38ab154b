"""What a GPU and its links can do: spec-sheet peaks, the fraction of them dsmesh's kernels
reach (measured on one H200, docs/BENCHMARKS.md and docs/KERNELS.md), and the all-to-all and
KV-transfer rates DeepEP and Mooncake publish.

A GPU without a measured table takes the H200's efficiencies against its own peaks: the
kernels are the same code, and on Hopper the fraction of peak they reach carries over. That
assumption is the first thing to re-measure on a new GPU (``python -m dsmesh.bench.gpu``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

GB = 1e9
TFLOP = 1e12


@dataclass(frozen=True)
class Kernels:
    """Fractions of a GPU's peaks that dsmesh's kernels reach, and fixed costs.

    Derived from one H200 (docs/BENCHMARKS.md, the rows named per field)."""

    copy_eff: float = 0.88  # 4,245 of 4,800 GB/s (copy in bench.gpu, 2026-11-29)
    matmul_eff: float = 0.79  # bf16 matmul 773-787 of 989 TFLOP/s (same runs)
    # FP8 GEMM math rate once the weights are read (time = bytes / bandwidth + FLOPs / rate):
    # V3's 256 experts took 15.14 ms at 512 rows per expert and 6.01 ms at 128 (2026-11-29)
    gemm_eff: float = 0.46
    # bf16 routed experts: V2-Lite's 64 experts took 1.076 ms for 4096 tokens (`_grouped_mm`)
    grouped_bf16_eff: float = 0.53
    mla_decode_flop_eff: float = 0.49  # FlashInfer, 128 heads: 483-521 TFLOP/s
    mla_decode_mem_eff: float = 0.75  # FlashInfer, 16 heads batch 256: 3.6 TB/s of KV
    mla_prefill_eff: float = 0.29  # Triton MLA prefill, 128 heads x 2000: 285 TFLOP/s
    layer_us: float = 30.0  # norms, rope, routing, combine per layer (decode profile, 2026-11-29)
    prefill_other: float = 0.20  # prefill time outside GEMMs and attention (V3 layers, 2026-12-04)
    step_ms: float = 0.30  # launch and host time of one captured decode step
    # serving (scheduler, output processing, streaming) per running request per decode step:
    # `dsmesh up`'s TPOT p50 (2026-12-02: 11.98 / 28.24 ms at 64 / 256) less the kernel-ref
    # step at that batch (8.88 / 13.00 ms, 2026-12-01): 0.048 / 0.059 ms a request
    host_ms_per_request: float = 0.05
    # an eager prompt forward joining a decode step takes at least its launches (mixed steps,
    # 2026-12-02: a 200-token prompt cost 14.6 ms beyond the graph over V2-Lite's 27 layers)
    eager_layer_ms: float = 0.54
    # what a micro-batch of TBO adds to a layer beyond its pieces (its own small kernels, the
    # stream fork and join): `bench.ep_graphs` at batch 32 (2026-12-02) measured EP graphs
    # 9.82 ms and EP + TBO graphs 16.52 ms, 6.70 ms more, where the model's halves add 5.35 ms
    # (the weights read twice); the other 1.35 ms over 27 layers and 2 micro-batches
    tbo_layer_us: float = 25.0


@dataclass(frozen=True)
class GPU:
    """Spec-sheet figures of one GPU and the links it sits on."""

    name: str
    hbm_bytes_s: float
    bf16_flops: float  # dense
    fp8_flops: float  # dense
    memory_gib: float
    nvlink_bytes_s: float  # per direction, per GPU
    rdma_bytes_s: float  # NIC line rate per GPU
    gpus_per_node: int  # NVLink domain size
    gpus_per_host: int = 8  # GPUs one machine (one `dsmesh up`) holds
    kernels: Kernels = Kernels()
    sms: int = 132  # streaming multiprocessors (Hopper SXM: 132)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.hbm_bytes_s / 1e12:.2f} TB/s HBM, {self.bf16_flops / TFLOP:.0f} / "
            f"{self.fp8_flops / TFLOP:.0f} TFLOP/s bf16 / FP8, {self.memory_gib:.0f} GiB, NVLink "
            f"{self.nvlink_bytes_s / GB:.0f} GB/s x {self.gpus_per_node}, RDMA "
            f"{self.rdma_bytes_s / GB:.0f} GB/s"
        )


H200 = GPU("h200", 4.8e12, 989 * TFLOP, 1979 * TFLOP, 140.4, 450 * GB, 50 * GB, 8)
H100 = GPU("h100", 3.35e12, 989 * TFLOP, 1979 * TFLOP, 79.1, 450 * GB, 50 * GB, 8)
# one Blackwell GPU of a GB200 NVL72 rack: the whole rack is one NVLink domain; CX8 800 Gb/s
GB200 = GPU("gb200", 8.0e12, 2500 * TFLOP, 5000 * TFLOP, 184.0, 900 * GB, 100 * GB, 72, 4, sms=148)
# the H800 DeepSeek's own figures come from: H100 compute, NVLink cut to 200 GB/s a direction
H800 = GPU("h800", 3.35e12, 989 * TFLOP, 1979 * TFLOP, 79.1, 200 * GB, 50 * GB, 8)

GPUS: dict[str, GPU] = {g.name: g for g in (H100, H200, GB200, H800)}


def spec_gpu(spec: str) -> GPU:
    """A GPU from ``hbm_TBps,bf16_TFLOPs,fp8_TFLOPs,memory_GiB,nvlink_GBps,rdma_GBps,per_node``,
    with the H200's kernel efficiencies."""
    parts = spec.split(",")
    if len(parts) != 7:
        raise ValueError(
            "--gpu-spec: 7 comma-separated numbers: hbm TB/s, bf16 TFLOP/s, fp8 TFLOP/s, "
            f"memory GiB, NVLink GB/s, RDMA GB/s, GPUs per node (got {spec!r})"
        )
    try:
        hbm, bf16, fp8, mem, nvl, rdma, per_node = (float(p) for p in parts)
    except ValueError as exc:
        raise ValueError(f"--gpu-spec: {exc}") from exc
    if min(hbm, bf16, fp8, mem, nvl, rdma, per_node) <= 0:
        raise ValueError(f"--gpu-spec: every figure must be positive (got {spec!r})")
    host = min(8, int(per_node))
    return GPU(
        "spec", hbm * 1e12, bf16 * TFLOP, fp8 * TFLOP, mem, nvl * GB, rdma * GB, int(per_node), host
    )


# DeepEP V1 on H800 + CX7 400 Gb/s (docs/legacy.md of deepseek-ai/DeepEP): low-latency
# kernels at 128 tokens per rank, hidden 7168, top-8, FP8 dispatch and bf16 combine.
DEEPEP_LL_EP = (8, 16, 32, 64, 128, 256)
DEEPEP_LL_DISPATCH_US = (77.0, 118.0, 155.0, 173.0, 192.0, 194.0)
DEEPEP_LL_COMBINE_US = (114.0, 195.0, 273.0, 314.0, 369.0, 360.0)
DEEPEP_LL_TOKENS = 128
DEEPEP_LL_FIXED_US = 20.0  # a kernel's latency with nothing to send (assumption: not published)
# normal kernels, 4096 tokens per rank: bottleneck bandwidth per GPU over RDMA / NVLink
DEEPEP_NORMAL_RDMA = {16: 43 * GB, 32: 58 * GB, 64: 51 * GB}
DEEPEP_NORMAL_NVLINK = 153 * GB  # intranode EP 8, of H800's ~160 GB/s
# SMs the normal kernels hold while they run (DeepEP's Buffer.num_sms default, which SGLang
# keeps without a --deepep-config); the low-latency kernels' receive hook holds none
DEEPEP_NORMAL_SMS = 20
# torch.distributed all-to-all over NCCL (dsmesh's backend without DeepEP): a fraction of
# NVLink, plus the host synchronisation of its split sizes per call (assumption)
NCCL_A2A_EFF = 0.5
NCCL_A2A_FIXED_US = 60.0
# Mooncake Transfer Engine (its README): 190 GB/s over 8 x 400 Gb/s NICs, so 23.75 GB/s
# per GPU for KV pushed off the node; on one host, CUDA IPC measured 114 GB/s for one
# 1000-token V2-Lite request (docs/BENCHMARKS.md, 2026-12-01)
MOONCAKE_RDMA_PER_GPU = 190 * GB / 8
MOONCAKE_NVLINK_INTRA = 114 * GB
HANDOFF_CONTROL_MS = 2.84  # Reserve + Resolve + Commit + Await through kv_broker (median)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def deepep_low_latency_us(ep: int, tokens: float, hidden: int, topk: int) -> tuple[float, float]:
    """Dispatch and combine times (us) of DeepEP's low-latency kernels for ``tokens`` per
    rank: the published time at 128 tokens (interpolated in the EP size) minus a fixed
    latency, scaled by the bytes (tokens · top-k · hidden against 128 · 8 · 7168)."""
    scale = tokens * topk * hidden / (DEEPEP_LL_TOKENS * 8 * 7168)
    out = []
    for table in (DEEPEP_LL_DISPATCH_US, DEEPEP_LL_COMBINE_US):
        t = _interp(DEEPEP_LL_EP, table, ep)
        out.append(DEEPEP_LL_FIXED_US + (t - DEEPEP_LL_FIXED_US) * scale)
    return out[0], out[1]


def deepep_normal_rdma(ep: int) -> float:
    """Bottleneck RDMA bandwidth of DeepEP's normal kernels at ``ep`` ranks (bytes/s)."""
    keys = tuple(sorted(DEEPEP_NORMAL_RDMA))
    return _interp(keys, tuple(DEEPEP_NORMAL_RDMA[k] for k in keys), ep)
