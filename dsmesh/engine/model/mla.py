"""Multi-head latent attention (MLA) over the paged latent cache.

Per token the cache holds ``c`` = RMSNorm(kv latent) [kv_lora_rank] and ``k_pe`` = the rotated
shared rope key [qk_rope_head_dim]. ``kv_b_proj`` expands ``c`` into per-head ``k_nope`` and
``v``. Two equivalent ways to attend:

- naive (prefill): expand every cached token's latent to K/V, then ordinary attention;
- absorbed (decode): fold ``W_UK`` into the query and ``W_UV`` into the output, attending
  directly over the latents, which reads ``kv_lora_rank + rope`` values per token instead of
  ``heads * (nope + rope + v)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.forward_batch import DecodeMeta, ForwardBatch
from dsmesh.engine.model.fp8_linear import Fp8Linear, fuse_fp8_linears
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.linear_fusion import fuse_linears
from dsmesh.engine.model.mla_decode_backend import MLADecodeBackend, TorchMLADecode
from dsmesh.engine.model.mla_prefill_backend import MLAPrefillBackend, TorchMLAPrefill
from dsmesh.engine.model.norm import RMSNorm
from dsmesh.engine.model.rope import RotaryEmbedding
from dsmesh.kernels.fp8_linear import fp8_linear

ATTENTION_MODES = ("auto", "naive", "absorbed")


class MLAttention(nn.Module):
    """Parameter names match the checkpoint's ``self_attn.*`` tensors."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = cfg.mla
        self.layer_idx = layer_idx
        self.num_heads = mla.num_heads
        self.nope_dim = mla.qk_nope_head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.v_dim = mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.rotary = rotary
        h, qk = cfg.hidden_size, mla.qk_head_dim
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_cache_dim, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=mla.attention_bias)

        # Set by DeepseekForCausalLM.set_kernels, once, before serving.
        self.kernels = KernelChoice.reference()
        self.decode_backend: MLADecodeBackend = TorchMLADecode()
        self.prefill_backend: MLAPrefillBackend = TorchMLAPrefill()
        # One weight for both projections of the layer input (q or q_a, then kv_a), made by
        # fuse_input_projections at load; the two modules keep views of it.
        self.fused_input_weight: torch.Tensor | None = None
        # The same for projections held in FP8 (dsmesh/engine/model/fp8_linear.py):
        # (weight, weight_scale_inv), run by the backend of the first projection.
        self.fused_input_fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_lora] and W_UV [heads, v, kv_lora], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def fuse_input_projections(self) -> bool:
        """Move the two projections of the layer input into one weight, so that one GEMM
        computes both (dsmesh/engine/model/linear_fusion.py; FP8 projections fuse when the
        first fills whole 128-row scale blocks; biased ones keep two GEMMs). Returns whether
        fused."""
        q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if isinstance(q, Fp8Linear):
            self.fused_input_fp8 = fuse_fp8_linears(q, self.kv_a_proj_with_mqa)
            return self.fused_input_fp8 is not None
        self.fused_input_weight = fuse_linears(q, self.kv_a_proj_with_mqa)
        return self.fused_input_weight is not None

    @property
    def input_fused(self) -> bool:
        """Whether :meth:`fuse_input_projections` has fused the two input projections."""
        return self.fused_input_weight is not None or self.fused_input_fp8 is not None

    def _project_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q or q_a, kv_a) of the layer input ``x`` [T, hidden]."""
        weight = self.fused_input_weight
        q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if self.fused_input_fp8 is not None:
            weight, scale_inv = self.fused_input_fp8
            both = fp8_linear(x, weight, scale_inv, q.backend)
        elif weight is not None:
            both = F.linear(x, weight)
        else:
            return q(x), self.kv_a_proj_with_mqa(x)
        kv_width = self.kv_a_proj_with_mqa.weight.shape[0]
        q, kv_a = both.split([weight.shape[0] - kv_width, kv_width], dim=1)  # one op, two views
        return q, kv_a

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mode: str = "auto",
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new latents into ``kv_pool``.

        Decode rows (one new token) attend through the decode backend, weight-absorbed;
        the other requests through the prefill backend ("naive" mode sends every request
        there, "absorbed" attends over latents in both)."""
        t = x.shape[0]
        q_in, kv_a = self._project_input(x)
        q = q_in if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_in))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        self._rope_and_cache(q, kv_a, kv_pool, batch.out_slots, cos, sin)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)

        out = torch.empty(t, self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        meta = batch.decode if mode != "naive" else None
        if meta is not None and meta.rows is None:
            self._decode(q_nope, q_pe, kv_pool, meta, out)
        elif meta is not None:
            rows = meta.rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], kv_pool, meta)
        if meta is None:
            prefill = list(range(batch.num_requests))
        elif meta.rows is None:
            prefill = []  # every row decodes (decode-only steps: no per-layer host loop)
        else:
            prefill = batch.prefill_ids
        if prefill:
            absorbed = mode == "absorbed"
            self.prefill_backend.forward(
                self, q_nope, q_pe, kv_pool, batch, prefill, out, absorbed=absorbed
            )
        return self.o_proj(out.view(t, self.num_heads * self.v_dim))

    def _rope_and_cache(
        self,
        q: torch.Tensor,
        kv_a: torch.Tensor,
        kv_pool: MLAKVPool,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rope on ``q``'s rope channels (in place); RMSNorm of the new latents and rope of
        their shared key, written to ``slots`` of this layer's cache (FP8 pools: quantised per
        token). One Triton launch (dsmesh.kernels.mla_rope.mla_decode_prep, or
        mla_decode_prep_fp8) when the kernels are chosen."""
        norm = self.kv_a_layernorm
        if self.kernels.triton and q.shape[0] and kv_pool.fp8:
            from dsmesh.kernels.mla_rope import mla_decode_prep_fp8

            kv, scales = kv_pool.layer_pages(self.layer_idx)
            mla_decode_prep_fp8(
                q, kv_a, norm.weight, norm.eps, cos, sin, kv, scales, slots,
                self.rotary.interleave, self.nope_dim, self.rope_dim, self.kv_lora_rank,
            )  # fmt: skip
            return
        if self.kernels.triton and q.shape[0]:
            from dsmesh.kernels.mla_rope import mla_decode_prep

            mla_decode_prep(
                q, kv_a, norm.weight, norm.eps, cos, sin, kv_pool.layer_slots(self.layer_idx),
                slots, self.rotary.interleave, self.nope_dim, self.rope_dim, self.kv_lora_rank,
            )  # fmt: skip
            return
        q[..., self.nope_dim :] = self.rotary(q[..., self.nope_dim :], cos, sin)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], -1)
        latent = norm(latent)
        k_pe = self.rotary(k_pe, cos, sin)
        kv_pool.write(self.layer_idx, slots, torch.cat([latent, k_pe], dim=-1))

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_pool: MLAKVPool,
        meta: DecodeMeta,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Weight-absorbed attention of single-token requests over their paged latents:
        q_nope [D, H, nope], q_pe [D, H, rope] -> [D, H, v] (into ``out`` when given).
        Head-major products (batched GEMMs over heads) on strided views: no copies."""
        d = q_nope.shape[0]
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, C]
        latent_out = torch.empty(
            self.num_heads, d, self.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device
        ).transpose(0, 1)
        kv, scales = kv_pool.layer_pages(self.layer_idx)
        self.decode_backend.forward(
            q_latent, q_pe, kv, meta, self.scale, out=latent_out, kv_scales=scales
        )
        if out is None:
            out = torch.empty(
                d, self.num_heads, self.v_dim, dtype=q_nope.dtype, device=q_nope.device
            )
        torch.bmm(latent_out.transpose(0, 1), w_uv.mT, out=out.transpose(0, 1))
        return out

    def _causal_mask(self, n: int, prefix: int, device: torch.device) -> torch.Tensor | None:
        """[n, prefix + n] additive mask: new token j sees context positions <= prefix + j."""
        if n == 1:
            return None
        q_pos = torch.arange(n, device=device)[:, None] + prefix
        k_pos = torch.arange(prefix + n, device=device)[None, :]
        return torch.zeros(n, prefix + n, device=device).masked_fill(k_pos > q_pos, float("-inf"))

    def _softmax(self, scores: torch.Tensor, n: int, prefix: int) -> torch.Tensor:
        mask = self._causal_mask(n, prefix, scores.device)
        if mask is not None:
            scores = scores + mask
        return scores.softmax(dim=-1, dtype=torch.float32)

    def attend_naive(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, prefix: int
    ) -> torch.Tensor:
        """q_nope [n, H, nope], q_pe [n, H, rope], ctx [S, kv_lora + rope] -> [n, H, v]."""
        s = ctx.shape[0]
        latent, k_pe = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(s, self.num_heads, self.rope_dim)], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        scores = torch.einsum("nhd,shd->hns", q, k) * self.scale
        probs = self._softmax(scores, q.shape[0], prefix).to(q.dtype)
        return torch.einsum("hns,shv->nhv", probs, v)

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, prefix: int
    ) -> torch.Tensor:
        """Same contract as :meth:`attend_naive`, attending over latents directly."""
        w_uk, w_uv = self.absorbed_weights()
        latent, k_pe = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        scores = torch.einsum("nhc,sc->hns", q_latent, latent)
        scores = (scores + torch.einsum("nhr,sr->hns", q_pe, k_pe)) * self.scale
        probs = self._softmax(scores, q_nope.shape[0], prefix).to(q_nope.dtype)
        out_latent = torch.einsum("hns,sc->nhc", probs, latent)
        return torch.einsum("nhc,hvc->nhv", out_latent, w_uv)
