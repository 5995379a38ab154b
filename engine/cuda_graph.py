"""Decode steps as CUDA graphs: one captured graph per (batch bucket, page bucket).

A decode step (every request feeds exactly one token) has the same work for every step of
the same batch size, so it can be captured once and replayed, which removes the launch gaps
of a few thousand small kernels per step. Capture needs static shapes and no host syncs,
which the eager path (:class:`engine.forward_batch.ForwardBatch`, per-request Python loops,
``bincount``, host-side expert maps) does not give. This module therefore holds a second,
static decode forward over fixed buffers:

- ``meta`` [4, max_batch] int64 on the device: token ids, positions, KV slots of the new
  tokens, and sequence lengths (including the new token);
- one page table per page bucket, [max_batch, pages] int32 (``pages`` a power of two, capped
  at the most pages one request can hold);
- attention through :func:`kernels.mla_decode.mla_decode` when importable (and the dtype is
  not float32), or FlashInfer's MLA kernel when chosen (its schedule is planned on the host
  before each step or replay; :mod:`kernels.mla_decode_flashinfer`), else the torch
  reference :func:`kernels.mla_decode.mla_decode_ref` (float32
  scores, a masked gather over the bucket's fixed width), which is static too;
- MoE with the router and experts of the model's own modules, but a static permutation
  (``argsort`` plus ``scatter_add_`` counts, device-side expert map) and, where
  ``torch._grouped_mm`` would fall back to host-side offsets (anything but bfloat16 on
  Hopper), a dense loop over experts with zero weights for unrouted pairs.

A batch of ``n`` requests runs in the smallest bucket ``b >= n``; the ``b - n`` padding rows
repeat row 0 exactly (same token, position, slot and pages), so they write the same KV
values to the same slot as row 0 and change nothing. Graphs are captured lazily, the first
time a bucket is needed, with that step's real inputs already in the buffers (the warm-up
run then writes exactly the KV the replay writes again). Without CUDA, or with
``use_graphs=False``, the same static forward runs eagerly, which is how CPU tests check it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.decode_attention import make_flashinfer
from engine.kv_cache import MLAKVPool, pages_for
from engine.mla import MLAttention
from engine.model import DeepseekForCausalLM
from engine.moe import DeepseekMoE
from engine.moe_dispatch import LocalDispatcher
from engine.routing import select_experts
from kernels._triton import use_triton
from kernels.mla_decode import mla_decode_ref

log = logging.getLogger(__name__)

DecodeAttention = Callable[..., torch.Tensor]

# Rows of the ``meta`` buffer.
_IDS, _POS, _SLOT, _LEN = range(4)


class _StepTensors(NamedTuple):
    """Per-step device tensors every layer of the static forward reads."""

    cos: torch.Tensor  # rope of the new tokens' positions
    sin: torch.Tensor
    slots: torch.Tensor  # KV slot of each new token
    table: torch.Tensor  # page table [b, pages] int32
    seq_lens: torch.Tensor  # context length per row, int32


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured (an op synchronised with the host, say); the
    caller may run that step, and later ones, eagerly."""


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself: 1, 2, 4, ..., max_batch."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def page_bucket(num_pages: int, max_pages: int, min_pages: int = 1) -> int:
    """Next power of two >= ``num_pages`` and >= ``min_pages``, capped at ``max_pages``."""
    if num_pages > max_pages:
        raise ValueError(f"{num_pages} pages exceed the most a request can hold ({max_pages})")
    p = 1
    while p < max(num_pages, min_pages):
        p *= 2
    return min(p, max_pages)


def load_decode_kernel() -> DecodeAttention | None:
    """The Triton MLA decode kernel, or None when it (or Triton) is not importable."""
    try:
        from kernels.mla_decode import mla_decode
    except Exception as exc:  # ImportError, or Triton failing to initialise
        log.info("MLA decode kernel unavailable (%s); CUDA graphs use the torch reference", exc)
        return None
    return mla_decode


def _mm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has ``torch.mm(a, b, out_dtype=torch.float32)`` for ``dtype`` here."""
    a = torch.zeros(1, 16, dtype=dtype, device=device)
    try:
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def graph_support_problem(model: DeepseekForCausalLM) -> str | None:
    """Why the static decode path cannot run this model, or None when it can."""
    loc = model.expert_location
    if loc.ep_size != 1:
        return "expert parallelism (collectives per step)"
    if loc.num_physical and loc.logical_to_physical.shape[2] != 1:
        return "redundant experts (replica choice per token)"
    for moe in model.moe_layers():
        if not isinstance(moe.dispatcher, LocalDispatcher):
            return f"dispatcher {type(moe.dispatcher).__name__}"
    return None


class CudaGraphRunner:
    """Static decode forward over fixed buffers, replayed as CUDA graphs per bucket.

    ``run`` takes one step's rows (token id, position, the request's pages) and returns
    float32 logits [n, vocab]; the tensor is a view of graph memory, valid until the next
    ``run``. ``attention`` is "auto" (a kernel when importable and dtype is not float32),
    "kernel" (dsmesh's Triton kernel), "flashinfer" (the optional library, planned on the
    host before each step: kernels.mla_decode_flashinfer) or "torch".
    """

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_pool: MLAKVPool,
        max_batch: int,
        max_tokens_per_request: int,
        use_graphs: bool = True,
        attention: str = "auto",
        moe_backend: str = "auto",
        min_page_bucket: int = 1,
    ) -> None:
        problem = graph_support_problem(model)
        if problem is not None:
            raise ValueError(f"the static decode path does not support {problem}")
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.buffer.device
        self.dtype = next(model.parameters()).dtype
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.page_size = kv_pool.page_size
        self.max_pages = min(pages_for(max_tokens_per_request, self.page_size), kv_pool.num_pages)
        # Short contexts share the smallest page table (the kernels read only each request's
        # own pages), so few page buckets cover the common contexts and warm_up captures them.
        self.min_page_bucket = min(max(1, min_page_bucket), self.max_pages)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.decode_attention = self._choose_attention(attention)
        self.grouped_experts = self._grouped_experts_capturable()
        self.meta = torch.zeros(4, max_batch, dtype=torch.int64, device=self.device)
        self.fused_moe = self._choose_moe(moe_backend)
        # Fused norm / rope / cache-write kernels (kernels.norm, kernels.mla_rope) replace
        # ~40 small launches per layer; off in float32, the exact-reference precision.
        self.fused_glue = self.attention_backend != "torch" and use_triton(self.meta)
        self.tables: dict[int, torch.Tensor] = {}
        self.expert_maps = self._expert_maps()
        self.input_projections = self._fuse_input_projections()
        self.router_weights = self._router_weights()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.num_replays = 0
        self.num_eager = 0
        self.keys_used: set[tuple[int, int]] = set()  # (batch bucket, page bucket) run so far

    # ---- set-up -----------------------------------------------------------------------------

    def _choose_attention(self, attention: str) -> DecodeAttention:
        self.flashinfer = make_flashinfer(
            attention,
            self.model,
            self.device,
            self.dtype,
            self.page_size,
            self.max_pages,
            graph=self.use_graphs,
        )
        if self.flashinfer is not None:
            self.attention_backend = "flashinfer"
            return self.flashinfer
        kernel = None
        if attention in ("auto", "kernel") and self.device.type == "cuda":
            kernel = load_decode_kernel()
        if attention == "kernel" and kernel is None:
            raise ValueError("attention='kernel' but kernels.mla_decode is not importable on CUDA")
        if attention == "auto" and self.dtype == torch.float32:
            kernel = None  # float32 is the reference precision: keep exact torch arithmetic
        self.attention_backend = "kernel" if kernel is not None else "torch"
        return kernel if kernel is not None else mla_decode_ref

    def _choose_moe(self, moe_backend: str) -> Callable[..., torch.Tensor] | None:
        """The fused decode MoE kernel (kernels.moe_fused) for bf16/fp16 on CUDA when
        ``moe_backend`` is "auto" or "fused"; None keeps the grouped-GEMM path ("grouped")."""
        if moe_backend not in ("auto", "fused", "grouped"):
            raise ValueError(f"moe_backend must be auto, fused or grouped, got {moe_backend!r}")
        usable = (
            self.device.type == "cuda"
            and self.dtype in (torch.bfloat16, torch.float16)
            and use_triton(self.meta)
        )
        if moe_backend == "fused" and not usable:
            raise ValueError("moe_backend='fused' needs bf16 or fp16 weights on CUDA")
        if moe_backend == "grouped" or not usable:
            self.moe_backend = "grouped" if self.grouped_experts else "dense"
            return None
        try:
            from kernels.moe_fused import fused_moe
        except Exception as exc:  # Triton missing or failing to initialise
            if moe_backend == "fused":
                raise
            log.info("fused MoE kernel unavailable (%s); CUDA graphs use grouped GEMMs", exc)
            self.moe_backend = "grouped" if self.grouped_experts else "dense"
            return None
        self.moe_backend = "fused"
        return fused_moe

    def _grouped_experts_capturable(self) -> bool:
        """torch._grouped_mm keeps its group offsets on the device only on its fast path
        (bfloat16 on sm90+); elsewhere it copies them to the host, which breaks capture."""
        if self.device.type != "cuda" or self.dtype != torch.bfloat16:
            return False
        return torch.cuda.get_device_capability(self.device) >= (9, 0)

    def _expert_maps(self) -> list[torch.Tensor]:
        """Per MoE layer, logical -> physical expert id on the device (one replica each)."""
        loc = self.model.expert_location
        if loc.num_physical == 0:
            return []
        if loc.logical_to_physical.shape[2] != 1:
            raise ValueError("the static decode path needs one replica per expert")
        return [
            loc.logical_to_physical[i, :, 0].to(self.device)
            for i in range(loc.logical_to_physical.shape[0])
        ]

    def _fuse_input_projections(self) -> dict[int, tuple[torch.Tensor, int]]:
        """Per layer, the weight of one GEMM for both projections of the layer input (``q_proj``
        or ``q_a_proj``, then ``kv_a_proj_with_mqa``) and the split point: the two weights
        move into one tensor and the modules keep views of it, so no memory is added and
        every other path reads the same values. Layers with biases or other module types
        keep two GEMMs."""
        fused: dict[int, tuple[torch.Tensor, int]] = {}
        for layer in self.model.model.layers:
            attn = layer.self_attn
            q = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
            kv = attn.kv_a_proj_with_mqa
            plain = all(type(m) is nn.Linear and m.bias is None for m in (q, kv))
            same = q.weight.dtype == kv.weight.dtype and q.weight.device == kv.weight.device
            if not (plain and same):
                continue
            split = q.weight.shape[0]
            weight = getattr(attn, "fused_input_weight", None)  # another runner's, reused
            views = () if weight is None else (weight[:split].data_ptr(), weight[split:].data_ptr())
            if views != (q.weight.data_ptr(), kv.weight.data_ptr()):
                with torch.no_grad():
                    weight = torch.cat([q.weight, kv.weight])
                q.weight.data, kv.weight.data = weight[:split], weight[split:]
                attn.fused_input_weight = weight
            fused[attn.layer_idx] = (weight, split)
        return fused

    def _router_weights(self) -> dict[int, torch.Tensor]:
        """Per MoE layer, the float32 router weight in the model's dtype where that loses
        nothing (checkpoints store it in bf16). On CUDA one GEMM with float32 output
        (``torch.mm(..., out_dtype=torch.float32)``) then replaces casting the input to
        float32 and a float32 GEMM: the same exact products, summed in float32."""
        if self.device.type != "cuda" or self.dtype not in (torch.bfloat16, torch.float16):
            return {}
        weights = {}
        for layer in self.model.model.layers:
            mlp = layer.mlp
            if isinstance(mlp, DeepseekMoE):
                w = mlp.gate.weight.detach()
                low = w.to(self.dtype)
                if torch.equal(low.float(), w):
                    weights[mlp.moe_layer_idx] = low
        if weights and not _mm_out_dtype_works(self.device, self.dtype):
            return {}
        return weights

    def _table(self, pages: int) -> torch.Tensor:
        if pages not in self.tables:
            self.tables[pages] = torch.zeros(
                self.max_batch, pages, dtype=torch.int32, device=self.device
            )
        return self.tables[pages]

    def set_moe_backend(self, moe_backend: str) -> None:
        """Switch the MoE path ("auto", "fused", "grouped") and drop captured graphs (A/B)."""
        self.fused_moe = self._choose_moe(moe_backend)
        self.graphs.clear()
        if self.use_graphs:  # a fresh pool: capturing into one whose graphs died can fail
            self.pool = torch.cuda.graph_pool_handle()

    def set_attention_backend(self, attention: str) -> None:
        """Switch decode attention ("auto", "kernel", "flashinfer", "torch") and drop
        captured graphs (A/B in benchmarks)."""
        self.decode_attention = self._choose_attention(attention)
        self.fused_glue = self.attention_backend != "torch" and use_triton(self.meta)
        self.graphs.clear()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()

    # ---- stepping ---------------------------------------------------------------------------

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step: row i feeds ``token_ids[i]`` at ``positions[i]`` of a request
        whose KV lives in ``pages[i]`` (in token order). Returns logits [n, vocab] float32.

        ``device_ids`` [n] (on the device) replaces ``token_ids``: the tokens a step still
        running on the GPU is producing (overlapped decode); the copy is ordered after it on
        the stream, and nothing here waits for the GPU."""
        n = len(token_ids)
        if not (n == len(positions) == len(pages)) or not self.can_run(n):
            raise ValueError(f"bad decode step: {n} rows (max {self.max_batch})")
        b = bucket_for(n, self.buckets)
        need = pages_for(max(positions) + 1, self.page_size)
        p = page_bucket(need, self.max_pages, self.min_page_bucket)
        table, seq_lens = self._load_inputs(b, p, token_ids, positions, pages)
        if self.flashinfer is not None:  # host-side schedule, read by every layer's launch
            self.flashinfer.plan(table, seq_lens)
        if device_ids is not None:
            if device_ids.shape != (n,):
                raise ValueError(f"device_ids must be [{n}], got {tuple(device_ids.shape)}")
            self.meta[_IDS, :n].copy_(device_ids)
            self.meta[_IDS, n:b].copy_(device_ids[:1].expand(b - n))
        self.keys_used.add((b, p))
        if not self.use_graphs:
            self.num_eager += 1
            with torch.inference_mode():
                return self.forward_static(b, p)[:n]
        key = (b, p)
        if key not in self.graphs:
            self._capture(key)
        graph, logits = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def warm_up(self, max_tokens: int) -> int:
        """Capture the graph of every batch bucket for every page bucket up to ``max_tokens``
        of context now, instead of on first use, where each capture (two warm-up forwards and
        the capture, ~0.1 s on V2-Lite) stalls every running request. Call it before any
        request exists: the warm-up steps write KV into the pool's first pages. Returns the
        number of graphs captured."""
        if not self.use_graphs or max_tokens <= 0:
            return 0
        ps = self.page_size
        top = page_bucket(
            min(pages_for(max_tokens, ps), self.max_pages), self.max_pages, self.min_page_bucket
        )
        before = len(self.graphs)
        p = page_bucket(1, self.max_pages, self.min_page_bucket)
        while True:
            for b in self.buckets:
                self.run([0] * b, [p * ps - 1] * b, [range(p)] * b)
            if p >= top:
                break
            p = page_bucket(p + 1, self.max_pages, self.min_page_bucket)
        torch.cuda.synchronize(self.device)
        self.keys_used.clear()
        return len(self.graphs) - before

    def _load_inputs(
        self,
        b: int,
        p: int,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fill the buffers of bucket (b, p): vectorised, one host->device copy per buffer.
        Returns the host page table [b, p] and sequence lengths [b] just uploaded."""
        n = len(token_ids)
        ps = self.page_size
        table = np.zeros((b, p), dtype=np.int32)
        held = np.empty(n, dtype=np.int64)
        for i, req_pages in enumerate(pages):
            k = min(len(req_pages), p)
            table[i, :k] = req_pages[:k]
            held[i] = len(req_pages)
        pos = np.asarray(positions, dtype=np.int64)
        short = np.nonzero((pos // ps + 1) > held)[0]
        if short.size:
            i = int(short[0])
            raise ValueError(f"row {i}: {held[i]} pages cannot hold position {pos[i]}")
        table[n:] = table[0]  # padding rows repeat row 0 exactly
        meta = np.empty((4, b), dtype=np.int64)
        meta[_IDS, :n] = token_ids
        meta[_POS, :n] = pos
        meta[_SLOT, :n] = table[np.arange(n), pos // ps].astype(np.int64) * ps + pos % ps
        meta[:, n:] = meta[:, :1]
        meta[_LEN] = meta[_POS] + 1
        self._upload(self.meta[:, :b], meta)
        self._upload(self._table(p)[:b], table)
        return table, meta[_LEN]

    def _upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Host -> device without waiting for the GPU: from pinned memory, ordered on the
        stream (a copy from pageable memory would synchronise with the running step)."""
        host = torch.from_numpy(src)
        if dst.is_cuda:
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _capture(self, key: tuple[int, int]) -> None:
        try:
            self._capture_unchecked(key)
        except Exception as exc:
            raise GraphCaptureError(f"capturing decode graph {key} failed: {exc}") from exc

    def _capture_unchecked(self, key: tuple[int, int]) -> None:
        b, p = key
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # JIT compiles, cuBLAS handles, cached probes
                    self.forward_static(b, p)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward_static(b, p)
        self.graphs[key] = (graph, logits)
        log.info("captured decode graph batch=%d pages=%d", b, p)

    # ---- the static forward ------------------------------------------------------------------

    def forward_static(self, b: int, p: int) -> torch.Tensor:
        """The decode forward over the first ``b`` rows of the buffers -> logits [b, vocab]."""
        m = self.model.model
        meta = self.meta[:, :b]
        x = m.embed_tokens(meta[_IDS])
        cos, sin = m.rotary.cos_sin(meta[_POS], x.dtype)
        step = _StepTensors(cos, sin, meta[_SLOT], self._table(p)[:b], meta[_LEN].to(torch.int32))
        if self.fused_glue:
            return self._forward_fused(x, step)
        for layer in m.layers:
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, step)
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            x = x + (self._moe(mlp, h) if isinstance(mlp, DeepseekMoE) else mlp(h))
        return self.model.lm_head(m.norm(x)).to(torch.float32)

    def _forward_fused(self, x: torch.Tensor, step: _StepTensors) -> torch.Tensor:
        """The same layers with each residual add fused into the next RMSNorm
        (kernels.norm.fused_add_rms_norm; the residual stream ``x`` is updated in place)."""
        from kernels.norm import fused_add_rms_norm

        m = self.model.model
        layers = list(m.layers)
        first = layers[0].input_layernorm
        h = first(x)
        for i, layer in enumerate(layers):
            out = self._attention(layer.self_attn, h, step)
            post = layer.post_attention_layernorm
            h = fused_add_rms_norm(out, x, post.weight, post.eps)
            mlp = layer.mlp
            out = self._moe(mlp, h) if isinstance(mlp, DeepseekMoE) else mlp(h)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            h = fused_add_rms_norm(out, x, norm.weight, norm.eps)
        return self.model.lm_head(h).to(torch.float32)

    def _attention(self, attn: MLAttention, x: torch.Tensor, step: _StepTensors) -> torch.Tensor:
        """MLAttention.forward for single-token rows, weight-absorbed, static shapes."""
        cos, sin, slots, table, seq_lens = step
        t = x.shape[0]
        q_in, kv_a = self._input_projections(attn, x)
        q = q_in if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(q_in))
        q = q.view(t, attn.num_heads, attn.nope_dim + attn.rope_dim)
        if self.fused_glue:
            # One launch: rope on q_pe in place; norm + rope of the new latent, into the cache.
            from kernels.mla_rope import mla_decode_prep

            norm = attn.kv_a_layernorm
            mla_decode_prep(
                q, kv_a, norm.weight, norm.eps, cos, sin,
                self.kv_pool.layer_slots(attn.layer_idx), slots, attn.rotary.interleave,
                attn.nope_dim, attn.rope_dim, attn.kv_lora_rank,
            )  # fmt: skip
            q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
        else:
            q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
            q_pe = attn.rotary(q_pe, cos, sin).contiguous()
            latent, k_pe = kv_a.split([attn.kv_lora_rank, attn.rope_dim], -1)
            latent = attn.kv_a_layernorm(latent)
            k_pe = attn.rotary(k_pe, cos, sin)
            self.kv_pool.write(attn.layer_idx, slots, torch.cat([latent, k_pe], dim=-1))
        w_uk, w_uv = attn.absorbed_weights()
        # Head-major products (batched GEMMs over heads) on strided views: no copies.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [t, h, c]
        kv = self.kv_pool.buffer[attn.layer_idx]
        latent_out = torch.empty(
            attn.num_heads, t, attn.kv_lora_rank, dtype=x.dtype, device=x.device
        ).transpose(0, 1)
        self.decode_attention(q_latent, q_pe, kv, table, seq_lens, attn.scale, out=latent_out)
        out = torch.empty(t, attn.num_heads, attn.v_dim, dtype=x.dtype, device=x.device)
        torch.bmm(latent_out.transpose(0, 1), w_uv.mT, out=out.transpose(0, 1))
        return attn.o_proj(out.view(t, attn.num_heads * attn.v_dim))

    def _input_projections(
        self, attn: MLAttention, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q or q_a, kv_a) of the layer input: one GEMM where the weights were fused."""
        fused = self.input_projections.get(attn.layer_idx)
        if fused is None:
            q = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
            return q(x), attn.kv_a_proj_with_mqa(x)
        weight, split = fused
        both = F.linear(x, weight)
        return both[:, :split], both[:, split:]

    def _moe(self, moe: DeepseekMoE, x: torch.Tensor) -> torch.Tensor:
        """DeepseekMoE.forward on one rank without host syncs."""
        expert_map = self.expert_maps[moe.moe_layer_idx] if self.expert_maps else None
        low = self.router_weights.get(moe.moe_layer_idx)
        logits = moe.gate(x) if low is None else torch.mm(x, low.t(), out_dtype=torch.float32)
        weights, physical = select_experts(
            logits, moe.routing, moe.gate.e_score_correction_bias, expert_map
        )
        if self.fused_moe is not None and moe.experts.fp8 is None:
            ex, mlp = moe.experts, moe.shared_experts
            if mlp is not None and mlp.gate_proj.weight.shape[0] % ex.intermediate_size == 0:
                # The shared MLP rides along as extra experts of the same width (in place).
                shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
                return self.fused_moe(x, ex.w13, ex.w2, physical, weights, shared=shared)
            add = mlp(x) if mlp is not None else None
            return self.fused_moe(x, ex.w13, ex.w2, physical, weights, add=add)
        if self.grouped_experts:
            routed = self._routed_grouped(moe, x, weights, physical)
        else:
            routed = self._routed_dense(moe, x, weights, physical)
        if moe.shared_experts is None:
            return routed
        return routed + moe.shared_experts(x)

    @staticmethod
    def _routed_grouped(
        moe: DeepseekMoE, x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor
    ) -> torch.Tensor:
        """Sort (token, expert) pairs by expert, grouped GEMM, weighted scatter-add back."""
        top_k = physical.shape[1]
        flat = physical.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(moe.experts.num_local, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        token = order // top_k
        expert_out = moe.experts(x.index_select(0, token), counts)
        w = weights.reshape(-1).index_select(0, order)[:, None].to(expert_out.dtype)
        out = torch.zeros(x.shape[0], expert_out.shape[1], dtype=x.dtype, device=x.device)
        return out.index_add_(0, token, expert_out * w)

    @staticmethod
    def _routed_dense(
        moe: DeepseekMoE, x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every row, weighted by its routing weight (0 where not routed).
        Costs E/k times the routed FLOPs: the fallback for dtypes without a capturable
        grouped GEMM (float32 tests, older GPUs)."""
        experts = moe.experts
        dense = torch.zeros(x.shape[0], experts.num_local, dtype=weights.dtype, device=x.device)
        dense.scatter_add_(1, physical, weights)
        dense = dense.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(experts.num_local):
            gate, up = F.linear(x, experts.w13[e]).chunk(2, dim=-1)
            out += F.linear(F.silu(gate) * up, experts.w2[e]) * dense[:, e : e + 1]
        return out
