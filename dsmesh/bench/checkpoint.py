"""Random-weight checkpoints of real DeepSeek shapes, written in the official format.

    python -m dsmesh.bench.checkpoint v2-lite /models/v2-lite-random [--device cuda]
        [--max-position-embeddings 2048]

Shapes: ``v2-lite`` (DeepSeek-V2-Lite's released config, bf16, 15.7B parameters, about
31 GB), ``v3-layers`` (DeepSeek-V3's layer shape, a few MoE layers, every linear weight but the
embeddings, the LM head and the routers in block-scaled FP8 as DeepSeek-V3 ships them;
``--dense-dtype bf16`` keeps the non-expert linears in bf16, the shape measured before
2026-12-06), and ``tiny`` / ``tiny-v3`` (the same
structures at toy sizes: CPU smoke tests). Weights are drawn on ``device`` (fast for
billions of parameters) and written shard by shard; the byte-level tokenizer goes beside
them, so every dsmesh command (``up``, ``generate``, ``bench``) takes the folder as
``--model``. ``--max-position-embeddings N`` writes a shorter context into the config (the
weights and RoPE are unchanged), so that requests which run "up to the context limit" end in
reasonable time. A folder written before with the same shape, seed and context is reused.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsmesh.bench.gpu import build_dsmesh, v2_lite_config, v3_layers_config
from dsmesh.engine.model.weights import official_state_dict
from dsmesh.engine.tokenizer import write_byte_level_tokenizer
from dsmesh.kernels.fp8 import quantize_fp8_block

SHAPES = ("v2-lite", "v3-layers", "tiny", "tiny-v3")
SHARD_BYTES = 4 << 30
MARKER = ".dsmesh-random-checkpoint.json"


def shape_config(
    shape: str, v3_layers: int = 4, max_position_embeddings: int | None = None
) -> dict[str, Any]:
    """The official config.json of ``shape``; ``max_position_embeddings`` (None: the
    shape's own) is the context length it declares."""
    if shape == "v2-lite":
        cfg = v2_lite_config()
    elif shape == "tiny":
        cfg = v2_lite_config(tiny=True)
    elif shape in ("v3-layers", "tiny-v3"):
        cfg = v3_layers_config(v3_layers, tiny=shape == "tiny-v3", fp8=True)
    else:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if max_position_embeddings is not None:
        if max_position_embeddings < 2:
            raise ValueError(f"max_position_embeddings must be >= 2, got {max_position_embeddings}")
        cfg["max_position_embeddings"] = max_position_embeddings
    return cfg


DENSE_DTYPES = ("fp8", "bf16")  # how a V3 shape stores its non-expert linears


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def _is_dense_linear(name: str) -> bool:
    """An attention projection, shared expert or dense MLP weight (DeepSeek-V3 stores them
    in FP8, kv_b_proj included; the embeddings, LM head, routers and norms stay bf16)."""
    if not (".self_attn." in name or ".mlp." in name) or not name.endswith(".weight"):
        return False
    return "norm" not in name and not name.endswith(".mlp.gate.weight")


def _quantize_experts(
    tensors: dict[str, torch.Tensor], block: list[int], dense_linears: bool = False
) -> None:
    """Routed expert weights (and with ``dense_linears`` every other linear weight that
    DeepSeek-V3 quantises) -> float8_e4m3fn + ``weight_scale_inv``, in place."""
    quantized = [
        n for n in tensors if _is_routed_expert(n) or (dense_linears and _is_dense_linear(n))
    ]
    for name in quantized:
        q, scale_inv = quantize_fp8_block(tensors[name], (block[0], block[1]))
        tensors[name] = q
        tensors[name + "_scale_inv"] = scale_inv


def _save_shards(tensors: dict[str, torch.Tensor], out: Path) -> int:
    """Shards of at most SHARD_BYTES plus ``model.safetensors.index.json``; returns bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {n: tensors[n].contiguous().cpu() for n in names}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def write_random_checkpoint(
    shape: str,
    out_dir: str | Path,
    device: str = "cuda",
    seed: int = 0,
    v3_layers: int = 4,
    max_position_embeddings: int | None = None,
    dense_dtype: str = "fp8",
) -> Path:
    """Write (or reuse) the random checkpoint of ``shape`` in ``out_dir``; returns it.
    ``max_position_embeddings``: the context length its config declares (None: the
    shape's own); ``dense_dtype`` (:data:`DENSE_DTYPES`): how a V3 shape stores its
    attention projections and shared experts."""
    if dense_dtype not in DENSE_DTYPES:
        raise ValueError(f"dense_dtype must be one of {DENSE_DTYPES}, got {dense_dtype!r}")
    out = Path(out_dir)
    recipe: dict[str, Any] = {"shape": shape, "seed": seed, "v3_layers": v3_layers}
    if max_position_embeddings is not None:  # absent otherwise: older folders stay valid
        recipe["max_position_embeddings"] = max_position_embeddings
    if shape in ("v3-layers", "tiny-v3"):
        recipe["dense_dtype"] = dense_dtype
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    raw = shape_config(shape, v3_layers, max_position_embeddings)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model = build_dsmesh(raw, torch.device(device), dtype, seed)
    tensors = official_state_dict(model)
    del model
    quant = raw.get("quantization_config")
    if quant is not None:
        _quantize_experts(tensors, quant["weight_block_size"], dense_dtype == "fp8")
    nbytes = _save_shards(tensors, out)
    del tensors
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    write_byte_level_tokenizer(out, model_max_length=raw["max_position_embeddings"])
    config = dict(raw, torch_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation))
    marker.write_text(json.dumps(recipe))
    print(
        f"wrote {shape} checkpoint ({nbytes / 1e9:.1f} GB) to {out} in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--v3-layers", type=int, default=4)
    ap.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        metavar="N",
        help="context length the config declares (default: the shape's own)",
    )
    ap.add_argument(
        "--dense-dtype",
        choices=DENSE_DTYPES,
        default="fp8",
        help="V3 shapes: the attention projections and shared experts in FP8 128x128 blocks "
        "(as DeepSeek-V3 ships them) or bf16",
    )
    args = ap.parse_args(argv)
    write_random_checkpoint(
        args.shape,
        args.out_dir,
        args.device,
        args.seed,
        args.v3_layers,
        args.max_position_embeddings,
        args.dense_dtype,
    )


if __name__ == "__main__":
    main()
