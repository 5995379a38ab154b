"""What a step costs when new prompts join a running decode batch (V2-Lite shape, in-process).

    python -m dsmesh.bench.mixed_steps [--decode-rows 64] [--prefix 4000] [--question 200]

The shared-prefix workload's steps, one kind at a time: ``--decode-rows`` requests decode
with contexts of prefix + question tokens while 1 or 4 new requests join, each with the same
cached prefix and its own question, so their chunks are short prompt chunks over long cached
prefixes. For each ``split_mixed_steps`` setting it reports the median wall time of a
decode-only step, of a mixed step, and of a prompt-only step (no decode rows), each synced
(no launch ahead), plus a torch.profiler summary of one mixed step (host time, GPU time,
host-device syncs). JSON to ``--out``; random weights (``dsmesh.bench.gpu``'s model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsmesh.bench.gpu import build_dsmesh, random_prompt, sync, v2_lite_config
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams

LONG = SamplingParams(max_new_tokens=1000, ignore_eos=True)


def timed_step(engine: LLMEngine) -> float:
    sync(engine.device)
    t = time.perf_counter()
    engine.step()
    sync(engine.device)
    return time.perf_counter() - t


def profile_step(engine: LLMEngine) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    sync(engine.device)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        engine.step()
        sync(engine.device)
    wall = time.perf_counter() - t
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    syncs = {
        e.key: e.count
        for e in events
        if e.key
        in (
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "aten::item",
            "aten::_local_scalar_dense",
            "cudaMemcpyAsync",
            "cudaEventSynchronize",
        )
    }
    return {
        "wall_ms_profiled": wall * 1e3,
        "device_busy_ms": device_us / 1e3,
        "syncs": syncs,
        "top_host": events.table(sort_by="self_cpu_time_total", row_limit=25),
    }


def measure(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prefix = random_prompt(vocab, args.prefix, 1)
    seed = iter(range(1000, 100_000))

    def prompt() -> list[int]:
        return prefix + random_prompt(vocab, args.question, next(seed))

    engine.generate([prompt()], SamplingParams(max_new_tokens=2))  # caches the prefix
    ids = [engine.add_request(prompt(), LONG) for _ in range(args.decode_rows)]
    while any(engine.get(i).is_prefilling for i in ids):  # type: ignore[union-attr]
        engine.step()
    for _ in range(5):
        engine.step()
    out: dict[str, Any] = {}
    out["decode_ms"] = 1e3 * statistics.median(timed_step(engine) for _ in range(args.repeats))
    for joining in (1, 4):
        times = []
        for _ in range(args.repeats):
            new = [engine.add_request(prompt(), LONG) for _ in range(joining)]
            times.append(timed_step(engine))
            timed_step(engine)
            for i in new:
                engine.abort(i)
        out[f"mixed_{joining}_ms"] = 1e3 * statistics.median(times)
    new = [engine.add_request(prompt(), LONG)]
    out["profile_mixed_1"] = profile_step(engine)
    engine.abort(new[0])
    for i in ids:
        engine.abort(i)
    times = []
    for _ in range(args.repeats):
        rid = engine.add_request(prompt(), LONG)
        times.append(timed_step(engine))
        engine.abort(rid)
    out["prompt_only_1_ms"] = 1e3 * statistics.median(times)
    print({k: v for k, v in out.items() if not k.startswith("profile")}, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("mixed_steps.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test")
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=4000)
    ap.add_argument("--question", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    raw = v2_lite_config(tiny=args.tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_dsmesh(raw, device, dtype)
    context = args.prefix + args.question + 1024
    results: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}}
    base = EngineConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        page_size=16,
        max_total_tokens=(args.decode_rows + 8) * context,
        max_running_requests=args.decode_rows + 8,
        max_batch_tokens=args.max_batch_tokens,
        prefix_cache=True,
        overlap_decode=False,
        cuda_graph_warmup_tokens=0,  # captured on first use, in the warm-up steps
    )
    for run, split in enumerate((False, True, False, True)):
        engine = LLMEngine(dataclasses.replace(base, split_mixed_steps=split), model=model)
        if engine.graph_runner is None and device.type == "cpu":
            from dsmesh.engine.runner.cuda_graph import CudaGraphRunner

            engine.graph_runner = CudaGraphRunner(
                model, engine.kv_pool, args.decode_rows + 8, context, use_graphs=False
            )
        results[f"{run}:split={split}"] = measure(engine, args, raw["vocab_size"])
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=2))
    for key in ("2:split=False", "3:split=True"):
        print(key, results[key]["profile_mixed_1"]["top_host"])
    return results


if __name__ == "__main__":
    main()
