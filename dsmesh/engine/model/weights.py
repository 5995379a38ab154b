"""Load and save DeepSeek checkpoints in safetensors, with the official tensor names.

- one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``;
- routed experts as ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, copied into
  every local physical slot that holds logical expert ``E``;
- FP8 e4m3 weights with a ``weight_scale_inv`` partner are dequantised to the model dtype;
  with ``keep_fp8`` the raw FP8 data stays reachable as ``model.fp8_weights[checkpoint_name]``;
  a model that holds a weight in FP8 itself (``Fp8Linear``, dsmesh/engine/model/fp8_linear.py)
  gets it and its ``weight_scale_inv`` copied as stored, never dequantised;
- multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) are skipped.

A missing, unexpected or mis-shaped tensor raises :class:`WeightError` naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.moe import RoutedExperts
from dsmesh.engine.model.staged_read import read_staged
from dsmesh.kernels.fp8 import dequantize_fp8_block

_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SCALE_SUFFIX = "_scale_inv"
WEIGHT_READS = ("auto", "staged", "mmap")  # how a checkpoint reaches the device (load_weights)


class WeightError(ValueError):
    """A checkpoint's tensors do not match its config; the message names the tensor."""


@dataclass(frozen=True)
class Fp8Weight:
    """Block-scaled FP8 weight as stored in the checkpoint (for the GPU FP8 path)."""

    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(N / bn), ceil(K / bk)] float32
    block_size: tuple[int, int]


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, per its index when it has one."""
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise WeightError(f"shard {f.name} listed in {index.name} is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {root}")
    return files


def checkpoint_dtypes(checkpoint_dir: str | Path) -> dict[str, str]:
    """tensor name -> its safetensors dtype ("F8_E4M3", "BF16", ...), from the headers only."""
    handles = _open_all(checkpoint_files(checkpoint_dir))
    return {name: h.get_slice(name).get_dtype() for name, h in handles.items()}  # type: ignore[attr-defined]


def _open_all(files: list[Path]) -> dict[str, object]:
    """tensor name -> open safetensors handle holding it (memory-mapped, read lazily)."""
    handles: dict[str, object] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
            handles[name] = handle
    return handles


def load_weights(
    model: DeepseekForCausalLM,
    checkpoint_dir: str | Path,
    keep_fp8: bool = False,
    staged: bool = False,
) -> None:
    """Fill ``model`` (already on its device and dtype) from the checkpoint. With ``staged``
    (what :func:`~dsmesh.engine.model.build.load_model` picks on CUDA by default) the
    tensors that go to the device as they are stored (not FP8) are read once, file by file,
    through reused buffers, pinned on CUDA (dsmesh/engine/model/staged_read.py); the others,
    and all of them by default, through safetensors' memory map."""
    cfg = model.config
    files = checkpoint_files(checkpoint_dir)
    names = _open_all(files)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    block = cfg.quant.weight_block_size if cfg.quant else (128, 128)

    # physical slots of each (layer, logical expert) on this rank
    local = model.expert_location.local_physical_ids(model.ep_rank)
    slots: dict[tuple[int, int], list[int]] = {}
    moe_layer_of = {layer: i for i, layer in enumerate(cfg.moe_layer_ids)}
    p2l = model.expert_location.physical_to_logical
    for layer, moe_idx in moe_layer_of.items():
        for j, phys in enumerate(local):
            slots.setdefault((layer, int(p2l[moe_idx, phys])), []).append(j)

    expected = {
        n for n in params if ".mlp.experts.w" not in n and not n.endswith("rotary.inv_freq")
    }
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    expected_experts = {
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer in moe_layer_of
        for e in range(cfg.moe.n_routed_experts)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    seen: set[str] = set()

    def skips(name: str) -> bool:
        """Whether ``name`` is never read here (a scale of a weight that is dequantised, a
        rotary table, an MTP layer)."""
        if name.endswith(_SCALE_SUFFIX):
            _check_scale_partner(names, name)
            if name not in expected:
                return True
        if name.endswith("rotary_emb.inv_freq"):
            return True
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            return True  # MTP (next-n prediction) layer: not used for serving
        if name not in expected and name not in expected_experts:
            raise WeightError(f"unexpected tensor {name!r} in checkpoint (not in this model)")
        seen.add(name)
        return False

    def expert_slots(name: str) -> tuple[RoutedExperts, str, list[int]] | None:
        em = _EXPERT_RE.match(name)
        if em is None:
            return None
        layer, logical = int(em.group(1)), int(em.group(2))
        experts = model.model.layers[layer].mlp.experts
        return experts, em.group(3), slots.get((layer, logical), [])

    def place(name: str, staged: torch.Tensor | None) -> None:
        """Read tensor ``name`` (``staged``: already on the device) into the model."""
        expert = expert_slots(name)
        if expert is not None:
            experts, proj, targets = expert
            if not targets:
                return  # not placed on this rank
            if not experts.has_dense:  # held in FP8 only: never dequantised
                _keep_fp8_only(names, name, model)
                return
            tensor = _read(names, name, block, model, keep_fp8, staged)
            _copy_expert(experts, proj, targets, tensor, name)
            return
        if params[name].dtype == torch.float8_e4m3fn:  # held in FP8: copied as stored
            tensor = names[name].get_tensor(name)  # type: ignore[attr-defined]
            if tensor.dtype != torch.float8_e4m3fn:
                raise WeightError(f"tensor {name!r} is {tensor.dtype}, expected FP8 e4m3")
        else:
            tensor = _read(names, name, block, model, keep_fp8, staged)
        _copy(params[name], tensor, name)

    to_read = [name for name in names if not skips(name)]
    done: set[str] = set()
    device = model.model.embed_tokens.weight.device
    if staged:
        stageable = {name for name in to_read if _stageable(names, name, expert_slots(name))}
        for name, tensor in read_staged(files, device, stageable):
            place(name, tensor)
            done.add(name)
    for name in to_read:
        if name not in done:
            place(name, None)

    missing = sorted((expected | expected_experts) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _check_scale_partner(names: dict[str, object], scale_name: str) -> None:
    """A ``*_scale_inv`` tensor must sit beside the FP8 weight it scales."""
    weight = scale_name[: -len(_SCALE_SUFFIX)]
    if weight not in names:
        raise WeightError(f"unexpected tensor {scale_name!r}: no {weight!r} beside it")
    dtype = names[weight].get_slice(weight).get_dtype()  # type: ignore[attr-defined]
    if dtype != "F8_E4M3":
        raise WeightError(f"unexpected tensor {scale_name!r}: {weight!r} is {dtype}, not FP8")


def _keep_fp8_only(names: dict[str, object], name: str, model: DeepseekForCausalLM) -> None:
    """Keep a routed expert's FP8 tensor and scales as they are (no dense copy)."""
    tensor = names[name].get_tensor(name)  # type: ignore[attr-defined]
    scale_name = name + _SCALE_SUFFIX
    if tensor.dtype != torch.float8_e4m3fn or scale_name not in names:
        raise WeightError(
            f"{name!r} is {tensor.dtype}, not FP8 with {scale_name!r}: the experts cannot be "
            "held in FP8 only; load with --no-fp8-experts"
        )
    scale = names[scale_name].get_tensor(scale_name)  # type: ignore[attr-defined]
    block = model.config.quant.weight_block_size if model.config.quant else (128, 128)
    model.fp8_weights[name] = Fp8Weight(tensor, scale.to(torch.float32), block)


def _stageable(
    names: dict[str, object], name: str, expert: tuple[RoutedExperts, str, list[int]] | None
) -> bool:
    """Whether ``name`` goes to the device as stored: not FP8 (dequantised, or kept on the
    host for the FP8 path) and, for a routed expert, placed on this rank in a dense copy."""
    if names[name].get_slice(name).get_dtype() == "F8_E4M3":  # type: ignore[attr-defined]
        return False
    return expert is None or (bool(expert[2]) and expert[0].has_dense)


def _read(
    names: dict[str, object],
    name: str,
    block: tuple[int, int],
    model: DeepseekForCausalLM,
    keep_fp8: bool,
    staged: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tensor ``name`` as the model takes it: ``staged`` (already on the device) when given,
    else read from the memory map; FP8 dequantised with its scales."""
    if staged is not None:
        return staged
    tensor = names[name].get_tensor(name)  # type: ignore[attr-defined]
    if tensor.dtype != torch.float8_e4m3fn:
        return tensor
    scale_name = name + _SCALE_SUFFIX
    if scale_name not in names:
        raise WeightError(f"FP8 tensor {name!r} has no {scale_name!r}")
    scale = names[scale_name].get_tensor(scale_name)  # type: ignore[attr-defined]
    try:
        dense = dequantize_fp8_block(tensor, scale.to(torch.float32), block)
    except ValueError as exc:
        raise WeightError(f"{scale_name}: {exc}") from exc
    if keep_fp8:  # keyed by checkpoint name, for the GPU FP8 path
        model.fp8_weights[name] = Fp8Weight(tensor, scale.to(torch.float32), block)
    return dense


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightError(
            f"tensor {name!r} has shape {list(src.shape)}, expected {list(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _copy_expert(
    experts: RoutedExperts, proj: str, targets: list[int], tensor: torch.Tensor, name: str
) -> None:
    """Checkpoint tensor ``name`` (an expert's ``proj``: gate, up or down) into each of
    ``experts``' local copies ``targets`` of that expert (w13 holds gate then up)."""
    inter = experts.intermediate_size
    for j in targets:
        if proj == "gate_proj":
            _copy(experts.w13[j, :inter], tensor, name)
        elif proj == "up_proj":
            _copy(experts.w13[j, inter:], tensor, name)
        else:
            _copy(experts.w2[j], tensor, name)


def official_state_dict(model: DeepseekForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (needs the trivial single-rank placement)."""
    loc = model.expert_location
    if loc.ep_size != 1 or loc.num_physical != loc.num_logical:
        raise ValueError("official_state_dict needs the trivial single-rank expert placement")
    out: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    inter = model.config.moe.moe_intermediate_size
    for name, tensor in state.items():
        if name.endswith("rotary.inv_freq"):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if ".mlp.experts.w" not in name:
            out[name] = tensor.detach().contiguous()
            continue
        prefix, kind = name.rsplit(".", 1)
        for e in range(tensor.shape[0]):
            base = f"{prefix}.{e}"
            if kind == "w13":
                out[f"{base}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                out[f"{base}.up_proj.weight"] = tensor[e, inter:].contiguous()
            else:
                out[f"{base}.down_proj.weight"] = tensor[e].contiguous()
    return out


def save_checkpoint_weights(
    tensors: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int | None = None
) -> None:
    """Write ``model.safetensors``, or shards plus an index when ``max_shard_bytes`` is set."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
