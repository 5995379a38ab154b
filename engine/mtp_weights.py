"""Load and save the MTP layers of a checkpoint (``model.layers.{num_hidden_layers + i}.*``).

The main model's loader (:mod:`engine.weights`) skips these tensors; this module reads them
into an :class:`engine.mtp.MTPDraft`. FP8 block weights are dequantised to the draft's dtype.
The checkpoint's copies of the embedding and the LM head (``embed_tokens``,
``shared_head.head``) are not read: the draft uses the main model's. A missing or mis-shaped
tensor raises :class:`engine.weights.WeightError` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.mtp import MTPDraft
from engine.weights import (
    _SCALE_SUFFIX,
    WeightError,
    _copy,
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
    for i, layer in enumerate(draft.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for e in range(experts.num_local):
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
        if local not in expected:
            raise WeightError(f"unexpected tensor {name!r} in checkpoint (not in the MTP layer)")
        seen.add(local)
        tensor = _read(names, name, block, draft, keep_fp8=False)  # type: ignore[arg-type]
        em = _EXPERT_RE.match(rest)
        if em is None:
            _copy(params[local], tensor, name)
            continue
        experts = draft.layers[index].mlp.experts
        e, proj = int(em.group(1)), em.group(2)
        inter = experts.intermediate_size
        if proj == "gate_proj":
            _copy(experts.w13[e, :inter], tensor, name)
        elif proj == "up_proj":
            _copy(experts.w13[e, inter:], tensor, name)
        else:
            _copy(experts.w2[e], tensor, name)
    missing = sorted(expected - seen)
    if missing:
        i, rest = missing[0].split(".", 2)[1:]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(
            f"checkpoint is missing MTP tensor 'model.layers.{first + int(i)}.{rest}'{more}"
        )


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
