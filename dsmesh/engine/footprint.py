"""What one engine process holds in device memory, from the model's shape alone.

Pure arithmetic over a :class:`ModelConfig` and the engine's choices, computed before any
weight is read, so that a plan that cannot fit is refused up front (``dsmesh up``'s memory
plan, dsmesh/cli/memory_plan.py) and the defaults that depend on memory can be derived
(dsmesh/engine/derived.py). All figures are bytes.

- **weights**: every parameter at its stored size: the compute dtype, except routed experts
  and, with ``fp8_linears``, the attention projections but kv_b_proj and the dense MLPs /
  shared experts, kept in FP8 (one byte a value plus a float32 scale per 128 x 128 block),
  and routers (float32); the MTP layer when speculating.
- **KV per token**: ``layers x (kv_lora_rank + qk_rope_head_dim) x cache dtype size`` (FP8:
  one byte a value, plus two float32 scales a token: dsmesh/engine/derived.py cache_bytes).
- **activations**: the peak of one forward of ``batch_tokens`` new tokens (the prefill chunk):
  the naive-MLA projections, the routed tokens' expert intermediates, the residual stream and
  the logits of the rows that sample. An estimate with a 25% margin, checked against
  ``torch.cuda.max_memory_allocated`` on the H200 (docs/GPU.md, "Memory plan").
- **graphs**: the CUDA graphs' private pool: one decode forward at the largest captured batch,
  plus a fixed cost per captured graph.
- **runtime**: the CUDA context, cuBLAS workspaces and allocator slack outside the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.engine.model.config import ModelConfig

GIB = 1 << 30
FP8_BLOCK = 128
RUNTIME_BYTES = 1 * GIB  # CUDA context (~0.5 GiB on Hopper), cuBLAS/Triton workspaces, slack
GRAPH_FIXED_BYTES = 8 << 20  # per captured graph: its own allocations besides the shared pool
ACTIVATION_MARGIN = 1.25
CPU_RUNTIME_BYTES = 512 << 20  # the interpreter, torch and gRPC in a CPU process


def _blocks(rows: int, cols: int) -> int:
    return -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)


def _attention_params(mc: ModelConfig) -> int:
    mla, h = mc.mla, mc.hidden_size
    heads, qk, nope_v = mla.num_heads, mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    if mla.q_lora_rank is None:
        q = h * heads * qk
    else:
        q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * qk
    kv = h * mla.kv_cache_dim + mla.kv_lora_rank + mla.kv_lora_rank * heads * nope_v
    return q + kv + heads * mla.v_head_dim * h + 2 * h  # o_proj, the two layer norms


def _dense_mlp_params(mc: ModelConfig, intermediate: int) -> int:
    return 3 * mc.hidden_size * intermediate


def _fp8_attention_matrices(mc: ModelConfig) -> list[tuple[int, int]]:
    """[N, K] of the attention projections held in FP8 with ``fp8_linears`` (kv_b_proj
    stays dense for the weight-absorbed decode)."""
    mla, h = mc.mla, mc.hidden_size
    heads = mla.num_heads
    if mla.q_lora_rank is None:
        q = [(heads * mla.qk_head_dim, h)]
    else:
        q = [(mla.q_lora_rank, h), (heads * mla.qk_head_dim, mla.q_lora_rank)]
    return [*q, (mla.kv_cache_dim, h), (h, heads * mla.v_head_dim)]


def _fp8_saving(matrices: list[tuple[int, int]], dtype_bytes: int) -> int:
    """Bytes saved by holding ``matrices`` in FP8 (one byte a value, float32 block scales)
    instead of ``dtype_bytes`` a value."""
    return sum(n * k * (dtype_bytes - 1) - 4 * _blocks(n, k) for n, k in matrices)


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights by kind (bytes); ``total`` is what the device holds."""

    embeddings: int  # input embedding and LM head
    attention: int
    dense: int  # dense MLPs and shared experts
    routed_experts: int
    routers: int  # float32 gates and their correction bias

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.dense + self.routed_experts + self.routers


def weight_bytes(
    mc: ModelConfig,
    dtype_bytes: int,
    fp8_experts: bool = False,
    mtp_layers: int = 0,
    expert_share: float = 1.0,
    fp8_linears: bool = False,
) -> WeightBytes:
    """The weights of ``mc`` in a ``dtype_bytes`` compute dtype. ``fp8_experts``: routed
    experts kept in FP8 with block scales; ``mtp_layers``: MTP draft layers loaded beside
    the model; ``expert_share``: the fraction of routed experts this process holds (one EP
    rank's, with redundant experts); ``fp8_linears``: the dense linears of an FP8 checkpoint
    (those of the model's layers, not the MTP layer's) kept in FP8 too."""
    h, vocab = mc.hidden_size, mc.vocab_size
    layers = mc.num_hidden_layers + mtp_layers
    moe_layers = len(mc.moe_layer_ids) + mtp_layers  # an MTP layer is a MoE layer
    dense_layers = layers - moe_layers
    moe = mc.moe
    embed = vocab * h * (1 if mc.tie_word_embeddings else 2)
    norms = h * (1 + mtp_layers * 3)  # final norm; an MTP layer's enorm, hnorm, its own norm
    mtp_proj = mtp_layers * 2 * h * h  # eh_proj
    attention = layers * _attention_params(mc)
    dense = dense_layers * _dense_mlp_params(mc, mc.intermediate_size)
    dense += moe_layers * _dense_mlp_params(mc, moe.n_shared_experts * moe.moe_intermediate_size)
    per_expert = 3 * h * moe.moe_intermediate_size
    experts = round(moe.n_routed_experts * expert_share) * moe_layers
    if fp8_experts:
        i = moe.moe_intermediate_size
        scales = _blocks(2 * i, h) + _blocks(h, i)
        routed = experts * (per_expert + 4 * scales)
    else:
        routed = experts * per_expert * dtype_bytes
    bias = moe.n_routed_experts if moe.topk_method == "noaux_tc" else 0  # correction bias
    routers = moe_layers * (moe.n_routed_experts * h + bias) * 4
    attention_bytes = (attention + norms + mtp_proj) * dtype_bytes
    dense_bytes = dense * dtype_bytes
    if fp8_linears and mc.quant is not None:
        n = mc.num_hidden_layers
        attention_bytes -= n * _fp8_saving(_fp8_attention_matrices(mc), dtype_bytes)
        shared = moe.n_shared_experts * moe.moe_intermediate_size
        mlps = [(mc.intermediate_size, mc.num_hidden_layers - len(mc.moe_layer_ids))]
        mlps += [(shared, len(mc.moe_layer_ids))] if shared else []
        for inter, count in mlps:
            mats = [(inter, h), (inter, h), (h, inter)]
            dense_bytes -= count * _fp8_saving(mats, dtype_bytes)
    return WeightBytes(
        embeddings=embed * dtype_bytes,
        attention=attention_bytes,
        dense=dense_bytes,
        routed_experts=routed,
        routers=routers,
    )


def kv_bytes_per_token(mc: ModelConfig, cache_bytes: float, mtp_layers: int = 0) -> int:
    """Bytes one token's KV takes over every cached layer (``cache_bytes`` per value; the
    FP8 cache's per-token scales are counted by passing its effective size)."""
    layers = mc.num_hidden_layers + mtp_layers
    return round(layers * mc.mla.kv_cache_dim * cache_bytes)


def activation_bytes(
    mc: ModelConfig, batch_tokens: int, dtype_bytes: int, sample_rows: int
) -> int:
    """Peak activations of one forward of ``batch_tokens`` new tokens, ``sample_rows`` of
    which produce logits (module docstring)."""
    mla, moe, h = mc.mla, mc.moe, mc.hidden_size
    heads = mla.num_heads
    # naive MLA over a chunk: q, k (nope + rope), v, kv_b's output, the attention output
    attention = heads * (2 * mla.qk_head_dim + 2 * mla.v_head_dim + mla.qk_nope_head_dim)
    # routed tokens: gate/up output (2I), the activation (I), the down output (H), per choice
    experts = moe.num_experts_per_tok * (3 * moe.moe_intermediate_size + h)
    dense = 3 * mc.intermediate_size
    residual = 6 * h  # hidden, residual, normed input, MoE output, shared experts' output...
    per_token = (attention + max(experts, dense) + residual) * dtype_bytes
    logits = sample_rows * mc.vocab_size * 4 * 2  # float32 logits and their softmax
    return round((batch_tokens * per_token + logits) * ACTIVATION_MARGIN)


def graph_bytes(mc: ModelConfig, max_batch: int, num_graphs: int, dtype_bytes: int) -> int:
    """The CUDA graphs' memory: one decode forward of ``max_batch`` rows (the graphs share
    one pool) and a fixed cost per graph."""
    if max_batch <= 0 or num_graphs <= 0:
        return 0
    return activation_bytes(mc, max_batch, dtype_bytes, max_batch) + num_graphs * (
        GRAPH_FIXED_BYTES
    )


GRAPH_PAGE_BUCKETS = 4  # page-table widths captured per batch bucket, about, at start-up


def graph_count(max_batch: int) -> int:
    """About how many graphs a runner captures up to ``max_batch``: its batch buckets
    (dsmesh/engine/runner/graph_buckets.py) times a few page-table widths each."""
    from dsmesh.engine.runner.graph_buckets import batch_buckets

    return len(batch_buckets(max_batch)) * GRAPH_PAGE_BUCKETS
