"""The model's answers to the seed's questions (docs/PLAN.md prints them beside the seed's
figures; ``dsmesh plan --questions`` prints them): why EP72 for decode and EP32 for
prefill, what GB200-class bandwidth changes, and where plain TP16 x 6 lands."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.plan.costs import kv_capacity_tokens, matmul_ms, weight_bytes_per_gpu
from dsmesh.plan.hardware import GB200, GPU, H100
from dsmesh.plan.shapes import V3, ModelShape
from dsmesh.plan.validate import decode_per_node, prefill_per_node, seed_parallel

SEED_DECODE_BATCH, SEED_CONTEXT, SEED_PROMPT = 256, 2000, 2048


@dataclass(frozen=True)
class EPRow:
    ep: int
    weights_gib: float  # per GPU
    kv_tokens: int  # per GPU
    batch: int  # sequences per GPU that fit at the seed's context (at most 256)
    tok_s_gpu: float


def decode_by_ep(gpu: GPU = H100, sizes: tuple[int, ...] = (8, 16, 32, 48, 72, 96)) -> list[EPRow]:
    """Decode at the seed's context for each EP size: the batch its KV pool holds, and the
    output tok/s per GPU at that batch (TBO, EPLB with 32 redundant experts)."""
    rows = []
    for ep in sizes:
        redundant = 32 + (-(V3.num_experts + 32)) % ep
        par = seed_parallel(ep, redundant=redundant)
        kv = kv_capacity_tokens(V3, gpu, par)
        batch = min(SEED_DECODE_BATCH, kv // (SEED_CONTEXT + 1))
        tok = (
            decode_per_node(gpu, V3, par, batch, SEED_CONTEXT) / gpu.gpus_per_node if batch else 0.0
        )
        rows.append(EPRow(ep, weight_bytes_per_gpu(V3, par) / 2**30, kv, batch, tok))
    return rows


def prefill_by_ep(gpu: GPU = H100, sizes: tuple[int, ...] = (8, 16, 32, 64)) -> list[EPRow]:
    """Prefill of 2K prompts at 16,384 tokens per GPU for each EP size."""
    rows = []
    for ep in sizes:
        par = seed_parallel(ep, redundant=32 + (-(V3.num_experts + 32)) % ep)
        kv = kv_capacity_tokens(V3, gpu, par)
        tok = prefill_per_node(gpu, V3, par, SEED_PROMPT) / gpu.gpus_per_node if kv else 0.0
        rows.append(EPRow(ep, weight_bytes_per_gpu(V3, par) / 2**30, kv, 0, tok))
    return rows


def gb200_ratio() -> dict[str, float]:
    """The seed's deployment on GB200 over H100, per GPU (EP72 decode is one NVL72 rack)."""
    return {
        "decode EP72, 256/GPU": decode_per_node(GB200, V3, seed_parallel(72), 256, SEED_CONTEXT)
        / GB200.gpus_per_node
        / (decode_per_node(H100, V3, seed_parallel(72), 256, SEED_CONTEXT) / H100.gpus_per_node),
        "prefill EP32, 2K prompts": prefill_per_node(GB200, V3, seed_parallel(32), SEED_PROMPT)
        / GB200.gpus_per_node
        / (prefill_per_node(H100, V3, seed_parallel(32), SEED_PROMPT) / H100.gpus_per_node),
    }


def tp_decode_ms(shape: ModelShape, gpu: GPU, tp: int, batch: int, context: float) -> float:
    """A decode step of one TP instance of ``tp`` GPUs holding ``batch`` sequences: every GPU
    reads 1/tp of every weight and, MLA's latent being shared by the heads, the whole KV of
    the batch for its 1/tp of the heads; two all-reduces of the hidden state a layer, ring
    over the slowest link (RDMA once the group spans nodes)."""
    k = gpu.kernels
    kv = batch * context * shape.kv_dim * shape.kv_bytes / (gpu.hbm_bytes_s * k.mla_decode_mem_eff)
    attn_flops = (
        batch * shape.decode_attn_flops(context) / tp / (gpu.bf16_flops * k.mla_decode_flop_eff)
    )
    attn = 1e3 * max(kv, attn_flops) + matmul_ms(
        shape.attn_params / tp, batch, shape.weight_bytes, gpu
    )
    expert_bytes = (
        (shape.num_experts * shape.expert_bytes + shape.num_shared_experts * shape.weight_bytes)
        * shape.expert_params
        / tp
    )  # every expert's 1/tp slice is read
    expert_flops = (
        2.0
        * batch
        * (shape.experts_per_token + shape.num_shared_experts)
        * shape.expert_params
        / tp
    )
    moe = 1e3 * (
        expert_bytes / (gpu.hbm_bytes_s * k.copy_eff) + expert_flops / (gpu.fp8_flops * k.gemm_eff)
    )
    link = gpu.nvlink_bytes_s if tp <= gpu.gpus_per_node else gpu.rdma_bytes_s
    allreduce = 2 * (1e3 * 2 * (tp - 1) / tp * batch * shape.hidden * 2 / link + 0.03)
    head = matmul_ms(shape.vocab * shape.hidden / tp, batch, shape.weight_bytes, gpu)
    layer = attn + moe + allreduce + k.layer_us / 1e3
    return shape.num_layers * layer + head + k.step_ms


def tp16_against_ep(gpu: GPU = H100) -> dict[str, float]:
    """TP16 x 6 on 96 GPUs against the seed's PD + EP deployment, output tok/s per GPU at
    the seed's workload (2000-token contexts), TP16 at the largest batch its KV holds."""
    tp = 16
    weights = V3.weight_bytes_total() / tp
    free = gpu.memory_gib * 2**30 * 0.85 - weights
    batch = int(free / (V3.kv_bytes_per_token * (SEED_CONTEXT + 1)))
    step = tp_decode_ms(V3, gpu, tp, batch, SEED_CONTEXT)
    tp_tok_s = batch / step * 1e3 / tp
    ep_decode = decode_per_node(gpu, V3, seed_parallel(72), 256, SEED_CONTEXT) / gpu.gpus_per_node
    # the whole deployment: 32 prefill + 72 decode GPUs against 96 TP GPUs, so decode's rate
    # over the 104 GPUs is a fair per-GPU figure (the seed's 12 nodes count 9 decode nodes)
    ep_all = ep_decode * 72 / (72 + 32)
    return {
        "tp16_batch": float(batch),
        "tp16_step_ms": step,
        "tp16_out_tok_s_gpu": tp_tok_s,
        "ep_decode_tok_s_gpu": ep_decode,
        "ratio_decode_gpus": ep_decode / tp_tok_s,
        "ratio_all_gpus": ep_all / tp_tok_s,
    }


def questions_report() -> str:
    """The answers as markdown tables."""
    lines = ["Decode, V3 on H100, 2000-token contexts, TBO, EPLB (32+ redundant experts):", ""]
    lines += [
        "| EP | weights GiB/GPU | KV tokens/GPU | sequences/GPU | out tok/s/GPU |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in decode_by_ep():
        lines.append(
            f"| {r.ep} | {r.weights_gib:.1f} | {r.kv_tokens:,} | {r.batch} | {r.tok_s_gpu:,.0f} |"
        )
    lines += ["", "Prefill, V3 on H100, 2K prompts, 16,384 tokens per GPU, TBO, EPLB:", ""]
    lines += ["| EP | weights GiB/GPU | KV tokens/GPU | in tok/s/GPU |", "|---:|---:|---:|---:|"]
    for r in prefill_by_ep():
        lines.append(f"| {r.ep} | {r.weights_gib:.1f} | {r.kv_tokens:,} | {r.tok_s_gpu:,.0f} |")
    lines += ["", "GB200 (NVL72) over H100, per GPU, the seed's deployment:", ""]
    lines += [f"- {k}: {v:.2f}x" for k, v in gb200_ratio().items()]
    tp = tp16_against_ep()
    lines += [
        "",
        f"TP16 x 6 on H100: {tp['tp16_batch']:.0f} sequences per instance fit, a step takes "
        f"{tp['tp16_step_ms']:.1f} ms, {tp['tp16_out_tok_s_gpu']:,.0f} out tok/s per GPU; PD + EP "
        f"decode {tp['ep_decode_tok_s_gpu']:,.0f} per decode GPU: "
        f"{tp['ratio_decode_gpus']:.1f}x per "
        f"decode GPU, {tp['ratio_all_gpus']:.1f}x counting the 32 prefill GPUs",
    ]
    return "\n".join(lines)
