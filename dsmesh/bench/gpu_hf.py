"""Part ``hf`` of the GPU benchmark (dsmesh/bench/gpu.py): transformers' DeepseekV2ForCausalLM
on the V2-Lite shape with random weights, on the same GPU, batch and context: prefill and
decode tokens/s, and dsmesh's speed-up over it (from part ``v2``'s figures of the same run)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dsmesh.bench.random_model import init_random_, random_prompt, v2_lite_config
from dsmesh.bench.roofline import sync


def hf_v2_model(raw: dict[str, Any], device: torch.device, dtype: torch.dtype):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    rope = dict(raw["rope_scaling"])
    rope_type = rope.pop("type")
    kwargs = {
        k: v
        for k, v in raw.items()
        if k not in ("model_type", "rope_scaling", "rope_theta", "scoring_func", "moe_layer_freq")
    }
    kwargs.update(n_group=None, topk_group=None)
    kwargs["rope_parameters"] = {"rope_type": rope_type, "rope_theta": raw["rope_theta"], **rope}
    config = DeepseekV2Config(**kwargs, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    init_random_(model, seed=0)
    return model.eval()


@torch.no_grad()
def bench_hf(model, batch: int, context: int, steps: int, device) -> dict[str, float]:
    """transformers: one prefill forward of the batch, then greedy decode steps with its
    cache (the loop generate runs, without its bookkeeping)."""
    vocab = model.config.vocab_size
    ids = torch.tensor([random_prompt(vocab, context, i) for i in range(batch)], device=device)
    sync(device)
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    sync(device)
    prefill = time.perf_counter() - t
    cache = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 2):
        sync(device)
        t = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        sync(device)
        times.append(time.perf_counter() - t)
    step = statistics.median(times[2:])
    return {
        "prefill_seconds": prefill,
        "prefill_tokens_per_s": batch * context / prefill,
        "decode_step_ms": step * 1e3,
        "decode_tokens_per_s": batch / step,
    }


def run_hf(args, device, results) -> None:
    raw = v2_lite_config(args.tiny)
    model = hf_v2_model(raw, device, args.dtype)
    rows = []
    ours = {r["batch"]: r for r in results.get("v2_lite", {}).get("decode", [])}
    our_prefill = results.get("v2_lite", {}).get("prefill", {}).get("tokens_per_s")
    for b in args.hf_batches:
        row: dict[str, Any] = {"batch": b, "context": args.context}
        try:
            row.update(bench_hf(model, b, args.context, args.steps, device))
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        if b in ours:
            mine = ours[b]["graphs"]["tokens_per_s"]
            row["dsmesh_decode_tokens_per_s"] = mine
            row["decode_speedup"] = mine / row["decode_tokens_per_s"]
            if our_prefill:
                row["prefill_speedup"] = our_prefill / row["prefill_tokens_per_s"]
                # Generating 2000 + N tokens: prefill time plus N steps, both systems.
                n = 256
                ours_t = b * args.context / our_prefill + n * b / mine
                hf_t = row["prefill_seconds"] + n * row["decode_step_ms"] / 1e3
                row["generate_256_speedup"] = hf_t / ours_t
        rows.append(row)
        print(f"  transformers batch {b}: {row}", flush=True)
    results["transformers"] = {
        "model": "transformers DeepseekV2ForCausalLM (V2-Lite shape, random weights)",
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "rows": rows,
    }
    del model
