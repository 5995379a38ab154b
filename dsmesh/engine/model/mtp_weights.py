"""Load and save the MTP layers of a checkpoint (``model.layers.{num_hidden_layers + i}.*``).

The main model's loader (:mod:`dsmesh.engine.model.weights`) skips these tensors; this module reads
them into an :class:`dsmesh.engine.model.mtp.MTPDraft`. FP8 block weights are dequantised to the
draft's dtype. Of the routed experts only those the draft's placement puts on its rank are read (all
of them on a single rank).
The checkpoint's copies of the embedding and the LM head (``embed_tokens``,
``shared_head.head``) are not read: the draft uses the main model's. A missing or mis-shaped
tensor raises :class:`dsmesh.engine.model.weights.WeightError` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dsmesh.engine.model.mtp import MTPDraft, mtp_moe_layers
from dsmesh.engine.model.weights import (
    _SCALE_SUFFIX,
    WeightError,
    _copy,
    _copy_expert,
    _open_all,
    _read,
    checkpoint_files,
)

_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


def load_mtp_weights(draft: MTPDraft, checkpoint_dir: str | Path) -> None:
    """Fill ``draft`` (already on its device and dtype) from the checkpoint's MTP layers."""
    cfg = draft.config
    first = cfg.num_hidden_layers
    names = _open_all(checkpoint_files(checkpoint_dir))
    params = {n: p for n, p in draft.state_dict(keep_vars=True).items() if n.startswith("layers.")}
    block = cfg.quant.weight_block_size if cfg.quant else (128, 128)
    expected = {n for n in params if ".mlp.experts.w" not in n}
    slots = _local_expert_slots(draft)
    for i, e in slots:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            expected.add(f"layers.{i}.mlp.experts.{e}.{proj}.weight")
    seen: set[str] = set()
    for name in names:
        m = _MTP_RE.match(name)
        if m is None or name.endswith(_SCALE_SUFFIX) or name.endswith("rotary_emb.inv_freq"):
            continue
        index = int(m.group(1)) - first
        if not 0 <= index < draft.num_layers:
            continue  # a main layer, or an MTP layer beyond num_nextn_predict_layers
        rest = m.group(2)
        if rest in SHARED_WITH_TARGET:
            continue
        local = f"layers.{index}.{rest}"
        em = _EXPERT_RE.match(rest)
        if local not in expected and _held_elsewhere(draft, index, em):
            continue
        if local not in expected:
            raise WeightError(f"unexpected tensor {name!r} in checkpoint (not in the MTP layer)")
        seen.add(local)
        tensor = _read(names, name, block, draft, keep_fp8=False)  # type: ignore[arg-type]
        if em is None:
            _copy(params[local], tensor, name)
            continue
        targets = slots[(index, int(em.group(1)))]  # each local copy of the expert
        _copy_expert(draft.layers[index].mlp.experts, em.group(2), targets, tensor, name)
    missing = sorted(expected - seen)
    if missing:
        i, rest = missing[0].split(".", 2)[1:]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(
            f"checkpoint is missing MTP tensor 'model.layers.{first + int(i)}.{rest}'{more}"
        )


def _held_elsewhere(draft: MTPDraft, index: int, expert: re.Match[str] | None) -> bool:
    """A routed expert of MTP layer ``index`` that another rank of the group holds."""
    cfg = draft.config
    if expert is None or index not in mtp_moe_layers(cfg):
        return False
    return int(expert.group(1)) < cfg.moe.n_routed_experts


def _local_expert_slots(draft: MTPDraft) -> dict[tuple[int, int], list[int]]:
    """(MTP layer index, logical expert) -> the local expert slots holding it on this rank
    (every expert, once each, under the default single-rank placement)."""
    location = draft.expert_location
    slots: dict[tuple[int, int], list[int]] = {}
    if location is None:
        return slots
    local = location.local_physical_ids(draft.ep_rank)
    for moe_idx, i in enumerate(mtp_moe_layers(draft.config)):
        p2l = location.physical_to_logical[moe_idx]
        for j, phys in enumerate(local):
            slots.setdefault((i, int(p2l[phys])), []).append(j)
    return slots


def mtp_state_dict(draft: MTPDraft) -> dict[str, torch.Tensor]:
    """The draft's weights under checkpoint names (``model.layers.{L}.*``), experts unstacked;
    without the shared embedding and head."""
    first = draft.config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, tensor in draft.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{first + int(i)}"
        if ".experts.w" not in rest:
            out[f"{prefix}.{rest}"] = tensor.detach().contiguous()
            continue
        kind = rest.rsplit(".", 1)[1]
        inter = draft.layers[int(i)].mlp.experts.intermediate_size
        for e in range(tensor.shape[0]):
            base = f"{prefix}.mlp.experts.{e}"
            if kind == "w13":
                out[f"{base}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                out[f"{base}.up_proj.weight"] = tensor[e, inter:].contiguous()
            else:
                out[f"{base}.down_proj.weight"] = tensor[e].contiguous()
    return out
