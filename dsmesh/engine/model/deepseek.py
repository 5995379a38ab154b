"""DeepSeek-V2/V3 decoder over ragged batches and the paged latent cache.

Module and parameter names follow the checkpoint (``model.layers.N.self_attn.q_a_proj`` ...),
except routed experts, which are stacked per rank (see
:class:`dsmesh.engine.model.moe.RoutedExperts`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.forward_batch import ForwardBatch
from dsmesh.engine.model.fp8_linear import Fp8Linear
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.mla import MLAttention
from dsmesh.engine.model.mla_decode_backend import (
    MLADecodeBackend,
    TorchMLADecode,
    make_decode_backend,
)
from dsmesh.engine.model.mla_prefill_backend import make_prefill_backend
from dsmesh.engine.model.moe import DeepseekMoE, DenseMLP
from dsmesh.engine.model.moe_dispatch import LocalDispatcher, MoEDispatcher, static_mode
from dsmesh.engine.model.norm import RMSNorm
from dsmesh.engine.model.rope import RotaryEmbedding


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
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``residual`` (None before the first layer: ``x`` is then the
        embedding) gains the previous sublayer's output ``x``; each residual add is fused into
        the norm that follows it (RMSNorm.add_forward, in place). Returns (this layer's MLP
        output, the residual stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn(h, batch, kv_pool, cos, sin, mode)
        h = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(h), residual


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
    Build on the ``meta`` device and load weights with
    :func:`dsmesh.engine.model.weights.load_weights`, or call :meth:`init_random` for tests and the
    tiny default model.
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
        self.kernels = KernelChoice.reference()
        self.decode_backend: MLADecodeBackend = TorchMLADecode()

    def set_kernels(
        self, kernels: KernelChoice, decode_backend: MLADecodeBackend | None = None
    ) -> None:
        """Choose, once and after the weights are in, what every module runs: the glue
        kernels, the decode and prefill attention backends (``decode_backend`` defaults to
        ``kernels.decode_attention`` built without a pool's page geometry, so not
        FlashInfer), the MoE path and the FP8 linears' GEMM; the input projections of each
        attention layer are fused into one weight here too. Calling it again switches
        kernels (A/B runs)."""
        device = self.lm_head.weight.device
        if decode_backend is None:
            name = kernels.decode_attention
            if name == "flashinfer":
                raise ValueError("a FlashInfer decode backend needs the KV pool's pages: pass it")
            decode_backend = make_decode_backend(
                name, name, device, (0, 0, 0, 1.0), torch.float32, 1, 1
            )
        prefill_backend = make_prefill_backend(kernels.triton)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.triton = kernels.triton
            elif isinstance(module, MLAttention):
                module.kernels = kernels
                module.decode_backend = decode_backend
                module.prefill_backend = prefill_backend
                if not module.input_fused:
                    module.fuse_input_projections()
            elif isinstance(module, DeepseekMoE):
                module.set_kernels(kernels, device)
            elif isinstance(module, DenseMLP):  # dense layers and shared experts
                module.triton = kernels.triton
                if not module.fused:
                    module.fuse_gate_up()
            elif isinstance(module, Fp8Linear):
                module.backend = kernels.fp8_linear
        self.kernels = kernels
        self.decode_backend = decode_backend

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
        rows = None if all_logits else batch.last_rows
        return self.compute_logits(self.hidden_states(batch, kv_pool, attention_mode, tbo, rows))

    @torch.inference_mode()
    def hidden_states(
        self,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        attention_mode: str = "auto",
        tbo: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` up to the LM head: the final hidden states (after the last norm)
        [T, hidden] of every new token, or [len(rows), hidden] of the rows ``rows`` (int64
        indices into the new tokens) only. :meth:`compute_logits` turns them into logits."""
        if tbo:
            x = self._two_batch_hidden(batch, kv_pool, attention_mode)
        else:
            m = self.model
            if batch.decode is not None and batch.decode.host is not None:
                self.decode_backend.plan(batch.decode)  # every layer's launch reads the plan
            x = m.embed_tokens(batch.input_ids)
            cos, sin = m.rotary.cos_sin(batch.positions, x.dtype)
            residual = None
            for layer in m.layers:
                x, residual = layer(x, residual, batch, kv_pool, cos, sin, attention_mode)
            if residual is not None:
                if rows is not None:
                    x, residual = x.index_select(0, rows), residual.index_select(0, rows)
                return m.norm.add_forward(x, residual)
        if rows is not None:
            x = x.index_select(0, rows)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] from :meth:`hidden_states` -> float32 logits [R, vocab]."""
        return self.lm_head(hidden).to(torch.float32)

    def _two_batch_hidden(self, batch: ForwardBatch, kv_pool: MLAKVPool, mode: str) -> torch.Tensor:
        """Two-batch overlap: per MoE layer the order is attention(0), dispatch(0) starts,
        attention(1), dispatch(1) starts, experts(0), experts(1), combine(0), combine(1), so
        each micro-batch's tokens travel while the other computes. Returns the hidden states
        [T, hidden] before the last norm, the micro-batches' rows end to end (batch order).
        A decode-only batch over device tensors (the graph runner's) splits at half its rows
        with no host work, so the same order is captured (dsmesh/engine/runner/cuda_graph.py)."""
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
        return torch.cat(xs)

    def static_dispatch(self) -> contextlib.AbstractContextManager[None]:
        """MoE dispatch in its fixed-shape mode (no host sync) for the forwards inside: what
        a CUDA graph captures. Under expert parallelism every rank of the group must run
        such a forward in the same step (the collectives pair up by shape)."""
        return static_mode(m.dispatcher for m in self.moe_layers())

    def moe_layers(self) -> list[DeepseekMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, DeepseekMoE)]
