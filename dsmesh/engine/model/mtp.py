"""DeepSeek-V3's multi-token-prediction (MTP) module, used as the draft model.

The checkpoint holds ``num_nextn_predict_layers`` MTP layers after the main ones, as
``model.layers.{num_hidden_layers + i}.*``: ``enorm``, ``hnorm``, ``eh_proj``, a full decoder
layer (MLA + MoE) and ``shared_head.norm``; the embedding and the LM head are the main model's
(the checkpoint's copies, ``embed_tokens`` and ``shared_head.head``, are not loaded).

MTP position ``p`` pairs the main model's hidden state of token ``p`` with the embedding of
token ``p + 1`` and predicts token ``p + 2``::

    h' = eh_proj(cat[enorm(embed(x[p + 1])), hnorm(h[p])])      # embedding first
    g  = shared_head.norm(decoder_layer(h', rope position p))
    logits = lm_head(g)

``h[p]`` is the main model's *final-normed* hidden state (the LM head's input), as SGLang's
``deepseek_nextn.py`` and vLLM's ``deepseek_mtp.py`` feed it; drafting further than one token
feeds ``g`` back in place of ``h`` (EAGLE's chain). The layer's attention caches its latents in
the engine's KV pool as layer ``num_hidden_layers + i``, in the request's own pages, so the
draft KV is allocated, shared by the prefix cache and freed with the request's pages.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.build import materialize
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.deepseek import DecoderLayer, DeepseekForCausalLM
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.forward_batch import ForwardBatch
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.mla_decode_backend import MLADecodeBackend, TorchMLADecode
from dsmesh.engine.model.moe import DeepseekMoE, DenseMLP
from dsmesh.engine.model.moe_dispatch import LocalDispatcher, MoEDispatcher, static_mode
from dsmesh.engine.model.norm import RMSNorm
from dsmesh.engine.model.rope import RotaryEmbedding

# The speculative decoding methods the engine offers (EngineConfig.speculative): drafting
# with this module, the checkpoint's MTP layers.
SPECULATIVE_METHODS = ("mtp",)


class SharedHead(nn.Module):
    """``shared_head.norm``; the head itself is the main model's ``lm_head``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One MTP layer; parameter names match ``model.layers.{L}.*`` of the checkpoint."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__(cfg, layer_idx, rotary, mlp)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class MTPDraft(nn.Module):
    """The MTP layers of a checkpoint, over the main model's embedding and LM head.

    By default the routed experts of an MTP layer all live on this rank (identity placement,
    local dispatch). In an expert-parallel group they are spread over the ranks as the
    target's are: ``expert_location`` places the routed experts of the MTP layers that are
    MoE ([num such layers, num_physical], in layer order), ``dispatcher`` moves tokens to
    them, and every draft forward is then a collective of the group.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        expert_location: ExpertLocation | None = None,
        dispatcher: MoEDispatcher | None = None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        if cfg.num_nextn_predict_layers <= 0:
            raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
        self.config = cfg
        moe_layers = mtp_moe_layers(cfg)
        n = cfg.moe.n_routed_experts
        if expert_location is None and moe_layers:
            expert_location = ExpertLocation.trivial(len(moe_layers), n)
        if dispatcher is None:
            dispatcher = LocalDispatcher(n)
        self.expert_location = expert_location
        self.ep_rank = ep_rank
        self.rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim)
        layers = []
        for i in range(cfg.num_nextn_predict_layers):
            layer_idx = cfg.num_hidden_layers + i
            mlp: nn.Module
            if i in moe_layers:
                assert expert_location is not None
                moe_idx = moe_layers.index(i)
                mlp = DeepseekMoE(cfg, moe_idx, expert_location, dispatcher, ep_rank)
            else:
                mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(MTPLayer(cfg, layer_idx, self.rotary, mlp))
        self.layers = nn.ModuleList(layers)
        # The main model's modules, held outside this module's parameters.
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None
        self.fp8_weights: dict[str, object] = {}  # unused: MTP weights are dequantised
        self.kernels = KernelChoice.reference()  # the target's, once set_kernels ran
        self.decode_backend: MLADecodeBackend = TorchMLADecode()

    def share_with(self, target: DeepseekForCausalLM) -> None:
        """Use ``target``'s embedding and LM head (DeepSeek-V3 shares them)."""
        self._shared = (target.model.embed_tokens, target.lm_head)

    @property
    def lm_head(self) -> nn.Linear:
        assert self._shared is not None, "call share_with(target) first"
        return self._shared[1]

    def set_kernels(self, target: DeepseekForCausalLM) -> None:
        """Run the kernels and attention backends ``target`` chose
        (:meth:`DeepseekForCausalLM.set_kernels`) in the draft's modules too."""
        DeepseekForCausalLM.set_kernels(self, target.kernels, target.decode_backend)  # type: ignore[arg-type]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def moe_layers(self) -> list[DeepseekMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, DeepseekMoE)]

    def static_dispatch(self) -> contextlib.AbstractContextManager[None]:
        """The draft's MoE dispatch in its fixed-shape mode for the forwards inside (as
        :meth:`DeepseekForCausalLM.static_dispatch`): in an expert-parallel group, every rank
        runs such a draft forward in the same step, at the same batch bucket."""
        return static_mode(m.dispatcher for m in self.moe_layers())

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_pool: MLAKVPool,
        hidden: torch.Tensor,
        step: int = 0,
        attention_mode: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over ``batch`` (its ``input_ids`` are the tokens ``x[p + 1]``, its
        ``positions`` the ``p``), given ``hidden`` [T, hidden_size], the hidden state of each
        row's position ``p`` (the main model's, or the previous draft step's ``g``).

        Uses MTP layer ``step % num_layers`` and writes its KV. Returns (``g`` [T,
        hidden_size] in the model dtype, float32 logits [T, vocab]) for every row.
        """
        assert self._shared is not None, "call share_with(target) first"
        embed, lm_head = self._shared
        layer = self.layers[step % len(self.layers)]
        if batch.decode is not None and batch.decode.host is not None:
            self.decode_backend.plan(batch.decode)  # as the target does before its layers
        x = embed(batch.input_ids)
        x = layer.eh_proj(torch.cat([layer.enorm(x), layer.hnorm(hidden.to(x.dtype))], dim=-1))
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        x, residual = layer(x, None, batch, kv_pool, cos, sin, attention_mode)
        g = layer.shared_head.norm.add_forward(x, residual)
        return g, lm_head(g).to(torch.float32)


def mtp_moe_layers(cfg: ModelConfig) -> list[int]:
    """Indices (0 = the first MTP layer) of the MTP layers whose MLP is MoE."""
    first = cfg.num_hidden_layers
    return [i for i in range(cfg.num_nextn_predict_layers) if cfg.is_moe_layer(first + i)]


def build_mtp(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    expert_location: ExpertLocation | None = None,
    dispatcher: MoEDispatcher | None = None,
    ep_rank: int = 0,
) -> MTPDraft:
    """An uninitialised draft in ``dtype`` on ``device`` (built on meta first, as the model;
    router weights stay float32); the placement arguments as :class:`MTPDraft`'s."""
    with torch.device("meta"):
        draft = MTPDraft(cfg, expert_location, dispatcher, ep_rank)
    draft = materialize(draft, dtype, device)
    draft.rotary.reset_buffers()
    return draft.eval()


@torch.no_grad()
def init_random_mtp(draft: MTPDraft, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights, as :func:`dsmesh.engine.model.build.init_random` does for a
    model."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(draft.state_dict(keep_vars=True).items()):
        if name.endswith("rotary.inv_freq"):
            continue
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * std
        tensor.copy_(value.to(tensor.dtype))
