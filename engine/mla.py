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
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import MLAKVPool
from engine.norm import RMSNorm
from engine.rope import RotaryEmbedding
from kernels._triton import use_triton

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

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_lora] and W_UV [heads, v, kv_lora], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mode: str = "auto",
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new latents into ``kv_pool``."""
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self.rotary(q_pe, cos, sin)

        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = self.rotary(k_pe, cos, sin)
        kv_pool.write(self.layer_idx, batch.out_slots, torch.cat([latent, k_pe], dim=-1))

        out = torch.empty(t, self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        batched_decode = mode != "naive" and batch.decode_slots is not None
        if batched_decode:
            rows = batch.last_rows[batch.decode_ids]
            out[rows] = self._decode_absorbed(q_nope[rows], q_pe[rows], kv_pool, batch)
        if use_triton(x) and mode != "absorbed":  # one Triton launch for every prefill
            self._prefill_fused(q_nope, q_pe, kv_pool, batch, out, skip_decode=batched_decode)
            return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
        start = 0
        for i, n in enumerate(batch.extend_lens):
            rows = slice(start, start + n)
            start += n
            if batched_decode and n == 1:
                continue
            ctx = kv_pool.read(self.layer_idx, batch.kv_slots[i]).to(x.dtype)
            absorbed = mode == "absorbed" or (mode == "auto" and n == 1)
            attend = self._attend_absorbed if absorbed else self._attend_naive
            out[rows] = attend(q_nope[rows], q_pe[rows], ctx, batch.prefix_lens[i])
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def _decode_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: MLAKVPool, batch: ForwardBatch
    ) -> torch.Tensor:
        """All single-token requests at once over their padded latent contexts.

        q_nope [B, H, nope], q_pe [B, H, rope] -> [B, H, v]; padding slots are masked out.
        """
        if use_triton(q_nope) and batch.decode_page_table is not None:
            return self._decode_kernel(q_nope, q_pe, kv_pool, batch)
        slots = batch.decode_slots
        assert slots is not None
        b, width = slots.shape
        ctx = kv_pool.read(self.layer_idx, slots.clamp(min=0).view(-1)).view(b, width, -1)
        latent, k_pe = ctx.to(q_nope.dtype).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)
        scores = torch.einsum("bhc,bsc->bhs", q_latent, latent)
        scores = (scores + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)) * self.scale
        scores = scores.masked_fill((slots < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q_nope.dtype)
        out_latent = torch.einsum("bhs,bsc->bhc", probs, latent)
        return torch.einsum("bhc,hvc->bhv", out_latent, w_uv)

    def _decode_kernel(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_pool: MLAKVPool, batch: ForwardBatch
    ) -> torch.Tensor:
        """:meth:`_decode_absorbed` through a paged decode kernel (CUDA): the one the engine
        planned for this batch (FlashInfer, ``batch.decode_attention``), else Triton's."""
        from kernels.mla_decode import mla_decode

        assert batch.decode_page_table is not None and batch.decode_seq_lens is not None
        attend = batch.decode_attention or mla_decode
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        out_latent = attend(
            q_latent.contiguous(),
            q_pe.contiguous(),
            kv_pool.buffer[self.layer_idx],
            batch.decode_page_table,
            batch.decode_seq_lens,
            self.scale,
        )
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill_fused(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_pool: MLAKVPool,
        batch: ForwardBatch,
        out: torch.Tensor,
        skip_decode: bool,
    ) -> None:
        """Naive attention for every request not decoded in the batched path, in one Triton
        launch over the ragged batch (kernels.mla_prefill); writes their rows of ``out``."""
        from kernels.backends import choose
        from kernels.mla_prefill import mla_prefill

        choose("mla_prefill")  # logs once which backend runs
        chosen, rows, q_lens, k_lens = [], [], [], []
        start = 0
        for i, n in enumerate(batch.extend_lens):
            if not (skip_decode and n == 1):
                chosen.append(i)
                rows.append(torch.arange(start, start + n))
                q_lens.append(n)
                k_lens.append(batch.prefix_lens[i] + n)
            start += n
        if not chosen:
            return
        device = q_nope.device
        every_row = len(chosen) == len(batch.extend_lens)
        index = None if every_row else torch.cat(rows).to(device)
        ctx = kv_pool.read(self.layer_idx, torch.cat([batch.kv_slots[i] for i in chosen]))
        latent, k_pe = ctx.to(q_nope.dtype).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        cu = torch.tensor([[0, 0], *zip(q_lens, k_lens, strict=True)]).cumsum(0)
        cu = cu.to(device=device, dtype=torch.int32)
        res = mla_prefill(
            q_nope if index is None else q_nope.index_select(0, index),
            q_pe if index is None else q_pe.index_select(0, index),
            k_nope,
            k_pe,
            v,
            cu[:, 0].contiguous(),
            cu[:, 1].contiguous(),
            self.scale,
            max(q_lens),
        )
        if index is None:
            out.copy_(res)
        else:
            out.index_copy_(0, index, res)

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

    def _attend_naive(
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

    def _attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, prefix: int
    ) -> torch.Tensor:
        """Same contract as :meth:`_attend_naive`, attending over latents directly."""
        w_uk, w_uv = self.absorbed_weights()
        latent, k_pe = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        scores = torch.einsum("nhc,sc->hns", q_latent, latent)
        scores = (scores + torch.einsum("nhr,sr->hns", q_pe, k_pe)) * self.scale
        probs = self._softmax(scores, q_nope.shape[0], prefix).to(q_nope.dtype)
        out_latent = torch.einsum("hns,sc->nhc", probs, latent)
        return torch.einsum("nhc,hvc->nhv", out_latent, w_uv)
