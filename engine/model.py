"""DeepSeek-V2/V3 decoder over ragged batches and the paged latent cache.

Module and parameter names follow the checkpoint (``model.layers.N.self_attn.q_a_proj`` ...),
except routed experts, which are stacked per rank (see :class:`engine.moe.RoutedExperts`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.expert_location import ExpertLocation
from engine.forward_batch import ForwardBatch
from engine.kv_cache import MLAKVPool
from engine.mla import MLAttention
from engine.moe import DeepseekMoE, DenseMLP
from engine.moe_dispatch import LocalDispatcher, MoEDispatcher
from engine.norm import RMSNorm
from engine.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_pool, cos, sin, mode)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekBackbone(nn.Module):
    def __init__(
        self, cfg: ModelConfig, location: ExpertLocation, dispatcher: MoEDispatcher, ep_rank: int
    ) -> None:
        super().__init__()
        # An explicit (uninitialised) weight skips nn.Embedding's random init, which on the
        # meta device would pull in torch._dynamo (~1 s of start-up) for values we overwrite.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim)
        layers = []
        moe_idx = 0
        for i in range(cfg.num_hidden_layers):
            mlp: nn.Module
            if cfg.is_moe_layer(i):
                mlp = DeepseekMoE(cfg, moe_idx, location, dispatcher, ep_rank)
                moe_idx += 1
            else:
                mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(DecoderLayer(cfg, i, self.rotary, mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The whole model for one rank.

    ``expert_location`` and ``dispatcher`` default to a single rank holding every expert.
    Build on the ``meta`` device and load weights with :func:`engine.weights.load_weights`,
    or call :meth:`init_random` for tests and the tiny default model.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        expert_location: ExpertLocation | None = None,
        dispatcher: MoEDispatcher | None = None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.config = cfg
        num_moe = len(cfg.moe_layer_ids)
        if expert_location is None:
            expert_location = ExpertLocation.trivial(num_moe, cfg.moe.n_routed_experts)
        if dispatcher is None:
            dispatcher = LocalDispatcher(expert_location.num_local_physical)
        self.expert_location = expert_location
        self.ep_rank = ep_rank
        self.model = DeepseekBackbone(cfg, expert_location, dispatcher, ep_rank)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # checkpoint name -> FP8 data, filled by load_weights(keep_fp8=True)
        self.fp8_weights: dict[str, object] = {}

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        attention_mode: str = "auto",
        all_logits: bool = False,
        tbo: bool = False,
    ) -> torch.Tensor:
        """Run the new tokens of ``batch``, caching their KV.

        Returns float32 logits [B, vocab] for each request's last new token, or [T, vocab]
        for every new token when ``all_logits``. With ``tbo`` the batch runs as two
        micro-batches whose MoE communication overlaps the other's compute (every rank of an
        expert-parallel group must then use it: the collectives pair up by micro-batch).
        """
        if tbo:
            return self._forward_two_batch(batch, kv_pool, attention_mode, all_logits)
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        cos, sin = m.rotary.cos_sin(batch.positions, x.dtype)
        for layer in m.layers:
            x = layer(x, batch, kv_pool, cos, sin, attention_mode)
        if not all_logits:
            x = x.index_select(0, batch.last_rows)
        return self.lm_head(m.norm(x)).to(torch.float32)

    def _forward_two_batch(
        self, batch: ForwardBatch, kv_pool: MLAKVPool, mode: str, all_logits: bool
    ) -> torch.Tensor:
        """Two-batch overlap: per MoE layer the order is attention(0), dispatch(0) starts,
        attention(1), dispatch(1) starts, experts(0), experts(1), combine(0), combine(1), so
        each micro-batch's tokens travel while the other computes."""
        m = self.model
        halves = batch.split()
        xs = [m.embed_tokens(h.input_ids) for h in halves]
        rope = [m.rotary.cos_sin(h.positions, xs[0].dtype) for h in halves]
        for layer in m.layers:
            mlp = layer.mlp
            attn: list[torch.Tensor] = []
            normed: list[torch.Tensor] = []
            started = []
            for i, h in enumerate(halves):
                cos, sin = rope[i]
                a = xs[i] + layer.self_attn(
                    layer.input_layernorm(xs[i]), h, kv_pool, cos, sin, mode
                )
                attn.append(a)
                normed.append(layer.post_attention_layernorm(a))
                if isinstance(mlp, DeepseekMoE):
                    started.append(mlp.start(normed[i]))
            if isinstance(mlp, DeepseekMoE):
                combining = [mlp.compute(p) for p in started]
                xs = [attn[i] + mlp.finish(normed[i], combining[i]) for i in range(2)]
            else:
                xs = [attn[i] + mlp(normed[i]) for i in range(2)]
        if not all_logits:
            xs = [x.index_select(0, h.last_rows) for x, h in zip(xs, halves, strict=True)]
        return self.lm_head(m.norm(torch.cat(xs))).to(torch.float32)

    def moe_layers(self) -> list[DeepseekMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, DeepseekMoE)]
